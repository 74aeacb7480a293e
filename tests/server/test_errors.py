"""Every error case returns its status and OpenAI's error body, and the server keeps serving."""

from __future__ import annotations

import base64
import io
import os
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from .support import data_url, image_message, make_image, wait_for

OK_MESSAGES = [{"role": "user", "content": "Hello there."}]
IMAGE_PARAM = "messages[0].content[1].image_url"


def assert_openai_error(body: dict[str, Any], code: str | None = None, param: Any = ...) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    if param is not ...:
        assert body["error"]["param"] == param


@pytest.fixture(autouse=True)
def still_serving(server: Any) -> Any:
    """After every error, the same server answers a normal request."""
    yield
    with server.client() as c:
        resp = c.chat.completions.create(model=server.model, messages=OK_MESSAGES, max_tokens=2)
    assert resp.choices[0].finish_reason in ("stop", "length")


def post_chat(server: Any, **body: Any) -> httpx.Response:
    body.setdefault("model", server.model)
    body.setdefault("messages", OK_MESSAGES)
    body.setdefault("max_tokens", 2)
    with server.http() as http:
        return http.post("/v1/chat/completions", json=body)


# -- 400 ------------------------------------------------------------------------------------


def _jpeg_bytes() -> bytes:
    buf = io.BytesIO()
    make_image().save(buf, format="JPEG")
    return buf.getvalue()


@pytest.mark.parametrize(
    "url",
    [
        "data:image/jpeg;base64,not-base64!!",
        "data:image/png;base64," + base64.b64encode(b"definitely not a png").decode(),
        "data:image/jpeg;base64," + base64.b64encode(_jpeg_bytes()[:200]).decode(),
        "data:image/gif;base64,R0lGODlhAQABAAAAACw=",
        "data:image/jpeg,rawbytes",
        "/etc/passwd",
    ],
    ids=["bad-base64", "not-an-image", "truncated-jpeg", "gif", "not-base64-encoded", "bare-path"],
)
def test_bad_image_is_400_naming_the_part(client, server, url):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=server.model, messages=image_message("Describe.", url), max_tokens=2
        )
    assert exc.value.status_code == 400
    assert_openai_error({"error": exc.value.body}, param=IMAGE_PARAM)


def test_http_image_from_unlisted_domain_is_refused(client, server):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=server.model,
            messages=image_message("Describe.", "http://example.com/cat.jpg"),
            max_tokens=2,
        )
    assert exc.value.code == "media_domain_not_allowed"
    assert exc.value.param == IMAGE_PARAM


def test_file_url_outside_allowed_path_is_refused(client, server, tmp_path):
    outside = tmp_path / "secret.png"
    make_image().save(outside)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=server.model, messages=image_message("Describe.", outside.as_uri()), max_tokens=2
        )
    assert exc.value.code == "local_media_not_allowed"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"priority": "urgent"}, "priority"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"top_k": -5}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"max_queue_seconds": -1}, "max_queue_seconds"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 250}}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
    ],
)
def test_bad_field_is_400_with_param(server, body, param):
    resp = post_chat(server, **body)
    assert resp.status_code == 400, resp.text
    assert_openai_error(resp.json(), param=param)


def test_malformed_json_is_400(server):
    with server.http() as http:
        resp = http.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
    assert resp.status_code == 400
    assert_openai_error(resp.json())


def test_prompt_over_the_context_is_400(client, server):
    long_text = "the person walks past the door " * 400  # well over max_model_len tokens
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": long_text}], max_tokens=2
        )
    assert exc.value.code == "context_length_exceeded"


# -- 401 / 404 / 413 ------------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_missing_or_wrong_api_key_is_401(server, key):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    resp = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": server.model, "messages": OK_MESSAGES},
        headers=headers,
    )
    assert resp.status_code == 401
    assert_openai_error(resp.json(), code="invalid_api_key")


def test_wrong_api_key_raises_authentication_error_in_sdk(server):
    with server.client(api_key="nope") as c, pytest.raises(openai.AuthenticationError):
        c.models.list()


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_the_openapi_schema_needs_the_key(server):
    """It lists every route and field: the same key as /v1."""
    assert httpx.get(server.base_url + "/openapi.json").status_code == 401
    with server.http() as http:
        schema = http.get("/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]


def test_unknown_model_is_404(client, server):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-nonexistent", messages=OK_MESSAGES)
    assert exc.value.code == "model_not_found"
    assert exc.value.param == "model"


def test_unknown_route_is_404_openai_shaped(server):
    with server.http() as http:
        resp = http.get("/v1/nothing-here")
    assert resp.status_code == 404
    assert_openai_error(resp.json())


def test_body_over_the_limit_is_413(server):
    noise = Image.frombytes("RGB", (700, 700), os.urandom(700 * 700 * 3))
    big = data_url(noise, "PNG")  # ~2 MB; the test server's limit is 1 MiB
    assert len(big) > 1024 * 1024
    resp = post_chat(server, messages=image_message("Describe.", big))
    assert resp.status_code == 413
    assert_openai_error(resp.json(), code="request_too_large")


def test_chunked_body_over_the_limit_is_413(server):
    def body() -> Any:
        yield b'{"model": "x", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"a" * 32768
        yield b'"}]}'

    with server.http() as http:
        resp = http.post(
            "/v1/chat/completions", content=body(), headers={"content-type": "application/json"}
        )
    assert resp.status_code == 413
    assert_openai_error(resp.json())


# -- 500 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["engine", "server"])
def test_unexpected_exception_is_500_without_traceback(server, monkeypatch, caplog, where):
    async def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internal detail")

    if where == "engine":
        monkeypatch.setattr(server.engine, "add_request", explode)
    else:  # a bug in our own code, outside the engine call
        monkeypatch.setattr(server.app.state.serving, "_engine_messages", explode)
    resp = post_chat(server)
    monkeypatch.undo()
    assert resp.status_code == 500
    assert_openai_error(resp.json(), code="internal_error")
    assert "secret" not in resp.text and "Traceback" not in resp.text
    assert any("secret internal detail" in (r.exc_text or "") for r in caplog.records)


# -- disconnects ----------------------------------------------------------------------------


def test_client_disconnect_mid_stream_aborts_and_frees_kv(client, server, request_logs):
    engine = server.engine
    before = engine.get_stats()
    stream = client.chat.completions.create(
        model=server.model,
        messages=OK_MESSAGES,
        stream=True,
        max_tokens=500,
        extra_body={"ignore_eos": True},
    )
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) >= 4:
            break
    stream.close()
    request_id = chunks[0].id.removeprefix("chatcmpl-")

    stats = wait_for(lambda: (s := engine.get_stats()).num_aborted > before.num_aborted and s)
    assert stats, "engine never counted the abort"
    assert wait_for(lambda: engine.get_stats().num_running == 0)
    assert wait_for(lambda: engine.get_stats().kv_blocks_used <= before.kv_blocks_used)
    metrics = httpx.get(server.base_url + "/metrics").text
    assert f"vision_serve_requests_aborted_total {float(stats.num_aborted)}" in metrics
    line = wait_for(lambda: _log_line(request_logs, request_id))
    assert line["status"] == 499 and line["error_code"] == "client_disconnected"
    assert line["output_tokens"] < 500


def test_client_disconnect_non_streaming_aborts(server):
    engine = server.engine
    before = engine.get_stats().num_aborted
    with server.http() as http, pytest.raises(httpx.ReadTimeout):
        http.post(
            "/v1/chat/completions",
            json={
                "model": server.model,
                "messages": OK_MESSAGES,
                "max_tokens": 900,
                "ignore_eos": True,
            },
            timeout=0.5,
        )
    assert wait_for(lambda: engine.get_stats().num_aborted > before)
    assert wait_for(lambda: engine.get_stats().num_running == 0)


def _log_line(caplog: Any, request_id: str) -> dict[str, Any] | None:
    from .support import request_log

    return request_log(caplog).get(request_id)
