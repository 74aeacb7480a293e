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


@pytest.hookimpl(tryfirst=True)  # before -m deselection sees the marks
def pytest_itemcollected(item: pytest.Item) -> None:
    """Tests on the trained detector are in the slow tier: on a fresh machine its build
    (``vision-serve make-detector``) takes 4-7 minutes of the 2 cores, more than the fast
    tier's budget allows; CI runs them (and builds it once per machine)."""
    if "trained_detector" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only tests that will run count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Train the person detector before the first test when a selected test needs it and no
    build is cached: a first build takes minutes, which no test's timeout should pay."""
    if not any("trained_detector" in getattr(item, "fixturenames", ()) for item in items):
        return
    from pipelines.detector_training import detector_dir, load_build, make_detector

    if load_build(detector_dir()) is not None:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter is not None else print
    say("tests need the trained person detector: building it once (vision-serve make-detector)")
    say(make_detector(log=say).summary())


@pytest.fixture(scope="session")
def trained_detector() -> Any:
    """``vision-serve make-detector``'s build (YOLO26n trained on synthetic frames): built
    once per machine into ``~/.cache/vision-serve/detectors/`` (a few minutes on 2 cores),
    reused by every later run. Returns its ``DetectorBuild`` (weights, imgsz, metrics)."""
    from pipelines.detector_training import make_detector

    return make_detector(log=lambda message: print(message, file=sys.stderr))


@pytest.fixture(scope="session")
def person_detector(trained_detector: Any) -> Any:
    """The real ``Detector`` on the trained weights, at the size it was trained for and the
    threshold picked on held-out frames (max F1): it finds
    the people of the test videos, so the gate runs on real detections (``min_persons: 1``)."""
    from pipelines.config import DetectorConfig
    from pipelines.detect import Detector

    build = trained_detector
    return Detector(DetectorConfig(weights=build.weights, imgsz=build.imgsz, conf=build.conf))


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
