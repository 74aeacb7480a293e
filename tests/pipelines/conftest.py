"""Fixtures for the pipeline tests: real redis-server, RTSP server, detector and VLM server.

The services themselves live in ``pipeline_helpers.py`` (importable by the tests too), and so
do the fixtures other test packages share: ``redis_server``, ``video_frames``, ``video_file``.
Redis runs with AOF ``appendonly yes`` + ``appendfsync always``: every write is fsynced
before Redis replies, so even a SIGKILL restart keeps everything acknowledged.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pipeline_helpers import (  # noqa: F401  (redis_server, video_*: fixtures, re-exported)
    REPO,
    RtspServer,
    VLMDouble,
    build_config,
    free_port,
    kill_group,
    redis_server,
    spawn_logged,
    video_file,
    video_frames,
    wait_healthy,
)


@pytest.fixture
def rtsp_server(video_frames: Path) -> Iterator[RtspServer]:  # noqa: F811
    with RtspServer(video_frames) as server:
        yield server


@pytest.fixture(scope="session")
def detector_config() -> Any:
    from pipelines.config import DetectorConfig

    return DetectorConfig(weights="yolo26n.yaml", imgsz=320, device="cpu")


@pytest.fixture(scope="session")
def detector(detector_config: Any) -> Any:
    """The real ultralytics YOLO26n (untrained: built from yolo26n.yaml), imgsz 320."""
    from pipelines.detect import Detector

    return Detector(detector_config)


@pytest.fixture
def vlm_double() -> Iterator[VLMDouble]:
    with VLMDouble() as double:
        yield double


@pytest.fixture
def closed_port_url() -> str:
    """An endpoint URL on which nothing listens (the VLM is down)."""
    return f"http://127.0.0.1:{free_port()}/v1"


@pytest.fixture(scope="session")
def vlm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Our own ``vision-serve serve`` with a tiny checkpoint; yields its ``/v1`` base URL."""
    if importlib.util.find_spec("vision_serve.server_cli") is None:
        pytest.skip("vision_serve.server_cli not importable yet (the server is being built)")
    model_dir = tmp_path_factory.mktemp("tiny-model") / "qwen2_vl-tiny"
    make = [sys.executable, "-m", "vision_serve.cli", "make-model", "--family", "qwen2_vl"]
    make += ["--preset", "tiny", "--out", str(model_dir)]
    subprocess.run(make, check=True, cwd=REPO, timeout=300)
    port = free_port()
    log_path = model_dir.parent / "serve.log"
    serve = [sys.executable, "-m", "vision_serve.cli", "serve", "--model", str(model_dir)]
    serve += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"]
    proc = spawn_logged(serve, log_path)
    try:
        health = f"http://127.0.0.1:{port}/health"
        wait_healthy(proc, health, log_path, "vision-serve serve", 180, interval=0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        kill_group(proc)


@pytest.fixture
def make_config() -> Any:
    """Build a validated PipelineConfig from overrides (test-sized bounds and timings)."""
    return build_config
