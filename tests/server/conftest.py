"""Fixtures for the HTTP server tests: one tiny real checkpoint, one real engine, one real
uvicorn server on a loopback port, and the official ``openai`` clients pointed at it.

Everything expensive is session-scoped: the checkpoint is generated once (a few seconds) and
the engine loaded once; tests that need a differently configured server (a queue limit, a
media policy) start their own small one with :func:`start_server`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from vision_serve.settings import ServerSettings

from .support import API_KEY, ENGINE_KWARGS, ServerHandle, make_engine, make_image, start_server


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-VL checkpoint (deterministic for seed 0)."""
    from engine.checkpoints import make_model

    return make_model("qwen2_vl", "tiny", tmp_path_factory.mktemp("ckpt") / "tiny-qwen2-vl")


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory the server may read file:// images from."""
    path = tmp_path_factory.mktemp("media")
    make_image(64, 64, (200, 30, 30)).save(path / "red.png")
    return path


@pytest.fixture(scope="session")
def engine(checkpoint: Path) -> Iterator[Any]:
    eng = make_engine(str(checkpoint))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine: Any, media_dir: Path) -> Iterator[ServerHandle]:
    """The shared server: API key on, file:// allowed under ``media_dir``, 1 MiB body limit."""
    settings = ServerSettings(
        api_key=API_KEY,
        allowed_local_media_path=media_dir,
        allowed_media_domains=["127.0.0.1"],
        allow_private_media_addresses=True,  # the test image host is on loopback
        max_request_body_mb=1.0,
        media_fetch_timeout_s=2.0,
    )
    handle = start_server(engine, settings)
    yield handle
    handle.stop()


@pytest.fixture
def client(server: ServerHandle) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c


@pytest.fixture
async def async_client(server: ServerHandle) -> Any:
    async with server.async_client() as c:
        yield c


@pytest.fixture
def request_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="vision_serve.requests")
    return caplog


@pytest.fixture(scope="session")
def offline(checkpoint: Any) -> Any:
    """The offline ``LLM`` on the same checkpoint and engine settings as the server."""
    from engine import LLM

    llm = LLM(model=str(checkpoint), **ENGINE_KWARGS)
    yield llm
    shutdown = getattr(llm, "shutdown", None)
    if shutdown:
        shutdown()
