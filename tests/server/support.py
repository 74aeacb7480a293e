"""Helpers shared by the server tests: starting servers, images, request logs."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from PIL import Image

from vision_serve.app import create_app
from vision_serve.settings import ServerSettings

API_KEY = "test-key"

# Small step budget so that an image prompt takes several prefill chunks (the interesting case
# for scheduling) while a short chat prompt fits in one. VISION_SERVE_TEST_DEVICE=cuda runs the
# same tests against an engine on a GPU (scripts/gpu_check.sh).
ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "device": os.environ.get("VISION_SERVE_TEST_DEVICE", "cpu"),
    "max_num_batched_tokens": 64,
    "max_num_seqs": 32,
    "max_model_len": 1024,
    "block_size": 16,
    "num_kv_blocks": 512,
    "num_threads": 1,
}


def make_engine(model: str, **overrides: Any) -> Any:
    """A real ``AsyncEngine`` on the test settings (plus ``overrides``)."""
    from engine import AsyncEngine, EngineArgs

    return AsyncEngine(EngineArgs(model=model, **{**ENGINE_KWARGS, **overrides}))


@dataclass
class ServerHandle:
    """A running server: its URL, app (for recorded state) and engine."""

    base_url: str
    app: Any
    engine: Any
    server: uvicorn.Server
    thread: threading.Thread
    settings: ServerSettings
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.app.state.serving.model_name

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.settings.api_key or "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60)
        return openai.OpenAI(base_url=self.v1, **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.settings.api_key or "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60)
        return openai.AsyncOpenAI(base_url=self.v1, **kwargs)

    def http(self) -> httpx.Client:
        headers = (
            {"authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        )
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def engine_is_idle(server: ServerHandle) -> bool:
    """Nothing left behind: no request scheduled or waiting, no KV block held, no detokenizer
    or output stream registered (what a finished, failed or abandoned request must release)."""
    stats = server.engine.get_stats()
    inner = server.engine.engine
    return (
        stats.num_running == 0
        and stats.num_waiting == 0
        and stats.kv_blocks_used == 0
        and not inner.detokenizers
        and not server.engine._streams
    )


def start_server(engine: Any, settings: ServerSettings) -> ServerHandle:
    """Serve ``create_app(engine, settings)`` with real uvicorn on a free loopback port, in a
    thread (so tests can read the engine's and app's recorded state directly)."""
    app = create_app(engine, settings)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_config=None, timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    while httpx.get(base_url + "/health").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("server never became healthy")
        time.sleep(0.05)
    return ServerHandle(base_url, app, engine, server, thread, settings)


# -- images and request logs ------------------------------------------------------------------


def make_image(width: int = 112, height: int = 112, color: tuple[int, int, int] = (30, 120, 200)):
    """A small image with some structure (a gradient and a square), so patches differ."""
    img = Image.new("RGB", (width, height), color)
    px = img.load()
    for x in range(width):
        for y in range(0, height, 4):
            px[x, y] = ((x * 3) % 256, (y * 5) % 256, 90)
    for x in range(width // 4, width // 2):
        for y in range(height // 4, height // 2):
            px[x, y] = (250, 250, 250)
    return img


def data_url(img: Image.Image, fmt: str = "JPEG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    mime = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}[fmt]
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"


def image_message(text: str, url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def request_log(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, Any]]:
    """Request id -> fields of its structured log line."""
    lines = {}
    for rec in caplog.records:
        if rec.name == "vision_serve.requests":
            fields = json.loads(rec.getMessage())
            lines[fields["id"]] = fields
    return lines


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll until ``predicate()`` is truthy (engine-side effects land asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_until_healthy(
    proc: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float = 120.0
) -> None:
    """Poll a server subprocess's ``/health`` until 200; fail with its log if it exits or
    the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.2)
