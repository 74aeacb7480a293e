"""A hand-written list of hostile and broken requests: each is refused with a 4xx in OpenAI's
error shape, quickly, and the server is healthy after each.

The list covers what an outside read found (huge seeds, unbounded images, over-long bodies)
and the classics of HTTP fuzzing (malformed JSON, wrong types, NaN, lone surrogates, bombs,
URLs pointing inside the network). Generated inputs are in ``test_schema_fuzz.py``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.reliability.test_validation import assert_serves_normally
from tests.server.support import ServerHandle, engine_is_idle, wait_for
from vision_serve.media import MediaLoader
from vision_serve.settings import ServerSettings

pytestmark = pytest.mark.timeout(180)

CHAT = "/v1/chat/completions"


def png(width: int, height: int, mode: str = "L") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_message(*urls: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What is here?"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


def chat(**fields: Any) -> bytes:
    body: dict[str, Any] = {
        "model": "MODEL",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    body.update(fields)
    return json.dumps(body).encode()


def raw_chat(text: str) -> bytes:
    """A body written by hand (JSON that ``json.dumps`` would not produce: NaN, escapes)."""
    return text.encode()


BOMB = png(20_000, 20_000)  # 400 Mpx declared, ~0.4 MB on the wire
BIG = png(5_000, 5_000)  # 25 Mpx: allowed alone, three of them are not
TINY = png(8, 8, "RGB")

# name -> (body bytes, expected status, expected error param or None, expected code or None)
CASES: dict[str, tuple[Callable[[], bytes], int, str | None, str | None]] = {
    "malformed_json": (lambda: b'{"model": "x", "messages": [', 400, None, None),
    "empty_body": (lambda: b"", 400, None, None),
    "json_null": (lambda: b"null", 400, None, None),
    "json_array": (lambda: b"[]", 400, None, None),
    "deeply_nested": (lambda: b"[" * 100_000 + b"]" * 100_000, 400, None, None),
    "messages_not_a_list": (lambda: chat(messages="hi"), 400, "messages", None),
    "messages_empty": (lambda: chat(messages=[]), 400, "messages", None),
    "message_not_an_object": (lambda: chat(messages=[1]), 400, "messages[0]", None),
    "unknown_role": (
        lambda: chat(messages=[{"role": "robot", "content": "x"}]),
        400,
        "messages[0].role",
        None,
    ),
    "content_wrong_type": (
        lambda: chat(messages=[{"role": "user", "content": 5}]),
        400,
        None,
        None,
    ),
    "unsupported_part_type": (
        lambda: chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]),
        400,
        "messages[0].content[0].type",
        None,
    ),
    "image_in_system_message": (
        lambda: chat(
            messages=[
                {"role": "system", "content": image_message(data_url(TINY))[0]["content"]},
                {"role": "user", "content": "hi"},
            ]
        ),
        400,
        "messages[0].content[1]",
        None,
    ),
    "temperature_nan": (
        lambda: raw_chat(
            '{"model":"MODEL","messages":[{"role":"user","content":"hi"}],"temperature":NaN}'
        ),
        400,
        "temperature",
        None,
    ),
    "top_p_infinity": (
        lambda: raw_chat(
            '{"model":"MODEL","messages":[{"role":"user","content":"hi"}],"top_p":Infinity}'
        ),
        400,
        "top_p",
        None,
    ),
    "max_tokens_zero": (lambda: chat(max_tokens=0), 400, "max_tokens", None),
    "max_tokens_negative": (lambda: chat(max_tokens=-5), 400, "max_tokens", None),
    "max_tokens_astronomical": (lambda: chat(max_tokens=10**30), 400, "max_tokens", None),
    "seed_past_uint64": (lambda: chat(seed=2**64), 400, "seed", None),
    "seed_float": (lambda: chat(seed=1.5), 400, "seed", None),
    "stop_list_too_long": (lambda: chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    "lone_surrogate_in_content": (
        lambda: raw_chat(
            '{"model":"MODEL","messages":[{"role":"user","content":"a\\ud800b"}],"max_tokens":2}'
        ),
        400,
        "messages[0].content",
        "invalid_unicode",
    ),
    "lone_surrogate_in_stop": (
        lambda: raw_chat(
            '{"model":"MODEL","messages":[{"role":"user","content":"hi"}],"stop":["\\udfff"]}'
        ),
        400,
        "stop[0]",
        "invalid_unicode",
    ),
    "lone_surrogate_in_model": (
        lambda: raw_chat('{"model":"\\ud800","messages":[{"role":"user","content":"hi"}]}'),
        400,
        "model",
        "invalid_unicode",
    ),
    "non_image_base64": (
        lambda: chat(messages=image_message(data_url(b"hello, not an image"))),
        400,
        "messages[0].content[1].image_url",
        "invalid_image",
    ),
    "invalid_base64": (
        lambda: chat(messages=image_message("data:image/png;base64,@@@not-base64@@@")),
        400,
        "messages[0].content[1].image_url",
        "invalid_image",
    ),
    "truncated_png": (
        lambda: chat(messages=image_message(data_url(png(64, 64, "RGB")[:60]))),
        400,
        "messages[0].content[1].image_url",
        "invalid_image",
    ),
    "svg_mime": (
        lambda: chat(messages=image_message(data_url(b"<svg/>", "image/svg+xml"))),
        400,
        "messages[0].content[1].image_url",
        "invalid_image",
    ),
    "decompression_bomb": (
        lambda: chat(messages=image_message(data_url(BOMB))),
        400,
        "messages[0].content[1].image_url",
        "image_too_large",
    ),
    "too_many_pixels_in_all": (
        lambda: chat(messages=image_message(*[data_url(BIG)] * 3)),
        400,
        "messages",
        "image_too_large",
    ),
    "too_many_images": (
        lambda: chat(messages=image_message(*[data_url(TINY)] * 17)),
        400,
        "messages",
        "too_many_images",
    ),
    "file_url": (
        lambda: chat(messages=image_message("file:///etc/passwd")),
        400,
        "messages[0].content[1].image_url",
        "local_media_not_allowed",
    ),
    "bare_path": (
        lambda: chat(messages=image_message("/etc/passwd")),
        400,
        "messages[0].content[1].image_url",
        "invalid_image_url",
    ),
    "cloud_metadata_url": (
        lambda: chat(messages=image_message("http://169.254.169.254/latest/meta-data/")),
        400,
        "messages[0].content[1].image_url",
        "media_domain_not_allowed",
    ),
    "loopback_url": (
        lambda: chat(messages=image_message("http://127.0.0.1:6379/")),
        400,
        "messages[0].content[1].image_url",
        "media_domain_not_allowed",
    ),
    "ipv6_loopback_url": (
        lambda: chat(messages=image_message("http://[::1]/x.png")),
        400,
        "messages[0].content[1].image_url",
        "media_domain_not_allowed",
    ),
    "private_network_url": (
        lambda: chat(messages=image_message("https://10.0.0.1/cam.jpg")),
        400,
        "messages[0].content[1].image_url",
        "media_domain_not_allowed",
    ),
    "gopher_url": (
        lambda: chat(messages=image_message("gopher://127.0.0.1:6379/_INFO")),
        400,
        "messages[0].content[1].image_url",
        "invalid_image_url",
    ),
    "body_over_50_mb": (lambda: chat(user="x" * (51 * 1024 * 1024)), 413, None, None),
    "text_prompt_of_45_mb": (
        lambda: chat(messages=[{"role": "user", "content": "hello world " * 4_000_000}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
}


def _post(server: ServerHandle, body: bytes) -> httpx.Response:
    body = body.replace(b'"MODEL"', json.dumps(server.model).encode(), 1)
    with server.http() as http:
        return http.post(CHAT, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_a_4xx_in_openais_shape_and_the_server_stays_healthy(
    healthy: ServerHandle, name: str
) -> None:
    make_body, status, param, code = CASES[name]
    t0 = time.monotonic()
    resp = _post(healthy, make_body())
    elapsed = time.monotonic() - t0
    assert resp.status_code == status, resp.text[:500]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    # refused at the door: no case may cost the server more than a few seconds
    assert elapsed < 20, f"{name} took {elapsed:.1f}s to refuse"
    assert httpx.get(healthy.base_url + "/health").status_code == 200
    assert healthy.engine.is_alive()


def test_after_the_whole_list_the_server_answers_and_holds_nothing(healthy: ServerHandle) -> None:
    for make_body, *_ in CASES.values():
        _post(healthy, make_body())
    assert_serves_normally(healthy)
    assert wait_for(lambda: engine_is_idle(healthy), timeout=10)


async def test_image_decoding_is_bounded_server_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many requests' images wait for a decode slot instead of all decoding at once (each
    decode holds a full-size bitmap)."""
    import vision_serve.media as media

    active = peak = 0
    lock = threading.Lock()
    real_decode = media.decode_image

    def slow_decode(data: bytes, param: str) -> Image.Image:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.05)
        try:
            return real_decode(data, param)
        finally:
            with lock:
                active -= 1

    monkeypatch.setattr(media, "decode_image", slow_decode)
    loader = MediaLoader(ServerSettings(max_concurrent_image_decodes=2))
    requests = [
        loader.load_all([(data_url(TINY), f"r{r}[{i}]") for i in range(4)]) for r in range(4)
    ]
    results = await asyncio.gather(*requests)
    assert [len(images) for images in results] == [4, 4, 4, 4]
    assert peak == 2


async def test_a_request_refused_for_its_total_pixels_decodes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vision_serve.media as media
    from vision_serve.errors import APIError

    calls = []
    monkeypatch.setattr(media, "decode_image", lambda *a: calls.append(a))
    loader = MediaLoader(ServerSettings(max_request_pixels=1000))
    with pytest.raises(APIError) as err:
        await loader.load_all([(data_url(png(30, 30)), "a"), (data_url(png(30, 30)), "b")])
    assert err.value.code == "image_too_large" and err.value.param == "messages"
    assert calls == []
