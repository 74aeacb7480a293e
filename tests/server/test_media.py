"""Image URL policy: http(s) only from listed hosts, file:// only under the allowed path."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from vision_serve.errors import APIError
from vision_serve.media import MediaLoader
from vision_serve.settings import ServerSettings

from .support import image_message, make_image


@pytest.fixture(scope="module")
def image_host(media_dir: Path) -> Iterator[str]:
    """A plain HTTP server on 127.0.0.1 serving ``media_dir`` (the shared server lists
    127.0.0.1 in --allowed-media-domains; ``localhost`` is not listed)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dir))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_http_image_from_allowed_host_is_fetched(client, server, image_host):
    messages = image_message("Describe.", f"http://{image_host}/red.png")
    resp = client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    text_only = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Describe."}], max_tokens=2
    )
    # 64x64 is resized to 56x56: 4x4 patches of 14, merged 2x2 into 4 tokens, plus 2 markers
    assert resp.usage.prompt_tokens - text_only.usage.prompt_tokens == 4 + 2


def test_same_server_under_unlisted_name_is_refused(client, server, image_host):
    port = image_host.split(":")[1]
    messages = image_message("Describe.", f"http://localhost:{port}/red.png")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    assert exc.value.code == "media_domain_not_allowed"


def test_missing_remote_image_is_400(client, server, image_host):
    messages = image_message("Describe.", f"http://{image_host}/missing.png")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    assert exc.value.code == "image_fetch_failed"


# -- the policy itself (no server needed) -----------------------------------------------------


def _loader(tmp_path: Path, **kwargs) -> MediaLoader:
    return MediaLoader(ServerSettings(allowed_local_media_path=tmp_path / "ok", **kwargs))


async def test_subdomains_of_listed_domains_are_allowed_others_not(tmp_path):
    loader = _loader(tmp_path, allowed_media_domains=["example.com"])
    assert loader._host_allowed("example.com")
    assert loader._host_allowed("cams.example.com")
    assert not loader._host_allowed("badexample.com")
    assert not loader._host_allowed("example.com.evil.org")


async def test_symlink_out_of_the_allowed_path_is_refused(tmp_path):
    (tmp_path / "ok").mkdir()
    make_image().save(tmp_path / "outside.png")
    (tmp_path / "ok" / "link.png").symlink_to(tmp_path / "outside.png")
    make_image().save(tmp_path / "ok" / "inside.png")
    loader = _loader(tmp_path)

    image = await loader.load((tmp_path / "ok" / "inside.png").as_uri(), "p")
    assert image.mode == "RGB"
    for path in ("ok/link.png", "ok/../outside.png"):
        with pytest.raises(APIError) as exc:
            await loader.load(f"file://{tmp_path}/{path}", "p")
        assert exc.value.code == "local_media_not_allowed"


async def test_oversized_image_is_refused(tmp_path):
    (tmp_path / "ok").mkdir()
    make_image(256, 256).save(tmp_path / "ok" / "big.png")
    loader = _loader(tmp_path, max_image_bytes=1000)
    with pytest.raises(APIError) as exc:
        await loader.load((tmp_path / "ok" / "big.png").as_uri(), "p")
    assert exc.value.code == "image_too_large"


async def test_a_listed_name_resolving_to_a_private_address_is_refused(tmp_path, media_dir):
    """The allow-list names hosts; a listed name pointing at loopback (or a metadata service)
    is refused unless --allow-private-media-addresses says the LAN is trusted."""
    make_image().save(media_dir / "lan.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dir))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://localhost:{httpd.server_address[1]}/lan.png"
    try:
        strict = _loader(tmp_path, allowed_media_domains=["localhost"])
        with pytest.raises(APIError) as exc:
            await strict.load(url, "p")
        assert exc.value.code == "media_domain_not_allowed" and "non-public" in exc.value.message
        trusting = _loader(
            tmp_path, allowed_media_domains=["localhost"], allow_private_media_addresses=True
        )
        assert (await trusting.load(url, "p")).mode == "RGB"
    finally:
        httpd.shutdown()


async def test_malformed_url_of_a_listed_host_is_a_400(tmp_path):
    loader = _loader(tmp_path, allowed_media_domains=["example.com"])
    for url in ("http://[::1/x.png", "http://example.com:99999/x.png"):
        with pytest.raises(APIError) as exc:
            await loader.load(url, "p")
        assert exc.value.status == 400


async def test_a_fifo_under_the_allowed_path_is_refused_not_waited_on(tmp_path):
    import os

    (tmp_path / "ok").mkdir()
    os.mkfifo(tmp_path / "ok" / "pipe.png")
    loader = _loader(tmp_path)
    with pytest.raises(APIError) as exc:
        await loader.load((tmp_path / "ok" / "pipe.png").as_uri(), "p")
    assert exc.value.code == "invalid_image"
