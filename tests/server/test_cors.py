"""CORS (vLLM's ``--allowed-origins`` family): preflights answered before auth, and the
headers a browser needs on real answers, errors included."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from vision_serve.settings import ServerSettings

from .support import API_KEY, ServerHandle, start_server

APP_ORIGIN = "https://cams.example"


@pytest.fixture(scope="module")
def narrow_server(engine) -> Iterator[ServerHandle]:
    handle = start_server(
        engine,
        ServerSettings(
            api_key=API_KEY,
            allowed_origins=[APP_ORIGIN],
            allowed_methods=["GET", "POST"],
            allowed_headers=["authorization", "content-type"],
        ),
    )
    yield handle
    handle.stop()


def _preflight(base_url: str, origin: str, headers: str = "authorization,content-type"):
    return httpx.options(
        base_url + "/v1/chat/completions",
        headers={
            "origin": origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": headers,
        },
    )


def test_preflight_from_an_allowed_origin_passes_without_the_key(narrow_server):
    resp = _preflight(narrow_server.base_url, APP_ORIGIN)
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "POST" in resp.headers["access-control-allow-methods"]
    assert "authorization" in resp.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in resp.headers


def test_preflight_from_another_origin_is_refused(narrow_server):
    resp = _preflight(narrow_server.base_url, "https://evil.example")
    assert resp.status_code == 400
    assert "access-control-allow-origin" not in resp.headers


def test_real_requests_carry_the_origin_header_errors_included(narrow_server):
    with narrow_server.http() as http:
        ok = http.get("/v1/models", headers={"origin": APP_ORIGIN})
        other = http.get("/v1/models", headers={"origin": "https://evil.example"})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "access-control-allow-origin" not in other.headers  # the browser hides the body
    unauthorised = httpx.get(narrow_server.v1 + "/models", headers={"origin": APP_ORIGIN})
    assert unauthorised.status_code == 401  # CORS does not replace the key
    assert unauthorised.headers["access-control-allow-origin"] == APP_ORIGIN


def test_defaults_are_vllms_any_origin_without_credentials(server):
    assert ServerSettings().allowed_origins == ["*"]
    resp = _preflight(server.base_url, "https://anywhere.example", headers="x-custom")
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in resp.headers
    with server.http() as http:
        real = http.get("/v1/models", headers={"origin": "https://anywhere.example"})
    assert real.headers["access-control-allow-origin"] == "*"


def test_vllm_style_json_lists_and_env_csv_are_accepted(monkeypatch):
    from vision_serve.cli import build_parser
    from vision_serve.server_cli import settings_from_namespace

    argv = ["serve", "--allowed-origins", '["https://a.example", "https://b.example"]',
            "--allowed-methods", "GET", "POST", "--allow-credentials"]  # fmt: skip
    settings = settings_from_namespace(build_parser(argv).parse_args(argv))
    assert settings.allowed_origins == ["https://a.example", "https://b.example"]
    assert settings.allowed_methods == ["GET", "POST"]
    assert settings.allow_credentials is True
    monkeypatch.setenv("VISION_SERVE_ALLOWED_HEADERS", "authorization,content-type")
    assert ServerSettings().allowed_headers == ["authorization", "content-type"]
