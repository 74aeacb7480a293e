"""Fixtures for the pipeline tests: real redis-server, RTSP server, detector and VLM server.

The services themselves live in ``pipeline_helpers.py`` (importable by the tests too).
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

import cv2
import numpy as np
import pytest
from pipeline_helpers import (
    FRAME_SIZE,
    REPO,
    RedisServer,
    RtspServer,
    VLMDouble,
    free_port,
    kill_group,
    people_images,
    wait_until,
)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def video_frames(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of numbered JPEGs: people (bus, zidane) alternating with empty grey frames."""
    out = tmp_path_factory.mktemp("frames")
    bus, zidane = people_images()
    blank = np.full((FRAME_SIZE[1], FRAME_SIZE[0], 3), 96, np.uint8)
    for i, image in enumerate([bus, blank, zidane, blank]):
        cv2.imwrite(str(out / f"frame_{i:05d}.jpg"), image)
    return out


@pytest.fixture(scope="session")
def video_file(video_frames: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same frames as an MP4 file source (5 fps, 4 s), written with OpenCV."""
    path = tmp_path_factory.mktemp("video") / "people.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 5.0, FRAME_SIZE)
    frames = [cv2.imread(str(p)) for p in sorted(video_frames.glob("*.jpg"))]
    for _ in range(5):
        for frame in frames:
            writer.write(frame)
    writer.release()
    return path


@pytest.fixture
def rtsp_server(video_frames: Path) -> Iterator[RtspServer]:
    server = RtspServer(video_frames)
    server.start()
    try:
        yield server
    finally:
        server.stop()


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
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            serve, cwd=REPO, start_new_session=True, stdout=log_file, stderr=subprocess.STDOUT
        )
    try:
        import httpx

        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"vision-serve serve exited: {log_path.read_text()[-3000:]}")
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 180, interval=0.5, what="vision-serve serve /health")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        kill_group(proc)


@pytest.fixture
def make_config(tmp_path: Path) -> Any:
    """Build a validated PipelineConfig from overrides (test-sized bounds and timings)."""
    from pipelines.config import parse_config

    def build(redis_url: str, **sections: Any) -> Any:
        data: dict[str, Any] = {
            "redis_url": redis_url,
            "detector": {"weights": "yolo26n.yaml", "imgsz": 320},
            "ingest": {"open_timeout_s": 5, "read_timeout_s": 3, "backoff_max_s": 2},
            "describer": {
                "model": "tiny",
                "timeout_s": 10,
                "retries": 0,
                "block_ms": 200,
                "claim_idle_s": 2,
                "claim_interval_s": 0.5,
                "backoff_initial_s": 0.1,
                "backoff_max_s": 0.5,
                "shutdown_grace_s": 3,
            },
            "metrics": {"pipeline_port": 0, "describe_port": 0},
        }
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return parse_config(data, "test")

    return build
