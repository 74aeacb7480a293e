"""``vision-serve pipeline`` / ``vision-serve describe`` as real processes: metrics, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pipeline_helpers import (
    REPO,
    descriptions,
    enqueue_frames,
    free_port,
    kill_group,
    pending_count,
    wait_until,
    write_config,
)

from pipelines.queue import read_stats

pytestmark = pytest.mark.timeout(60)

CLI = [sys.executable, "-m", "vision_serve.cli"]


def start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            CLI + args, cwd=REPO, start_new_session=True, stdout=out, stderr=subprocess.STDOUT
        )


def metrics_text(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return ""


@pytest.mark.timeout(120)
def test_pipeline_command_enqueues_exports_metrics_and_stops_on_sigterm(
    rtsp_server, redis_server, make_config, trained_detector, tmp_path: Path
):
    build = trained_detector  # finds the video's people: the gate runs on real detections
    config = make_config(
        redis_server.url,
        cameras=[{"id": "cli-cam", "url": rtsp_server.url, "fps": 2}],
        detector={"weights": build.weights, "imgsz": build.imgsz, "conf": build.conf},
        gate={"min_persons": 1, "cooldown_s": 0.5, "min_interval_s": 0},
    )
    port = free_port()
    path = write_config(tmp_path / "cameras.yaml", config)
    proc = start(["pipeline", "--config", str(path), "--metrics-port", str(port)], tmp_path / "log")
    client = redis_server.client()
    try:
        wait_until(lambda: client.xlen(config.queue.frames_stream) >= 2, 60, what="frames")
        text = wait_until(lambda: metrics_text(port), 10, what="/metrics")
        assert 'vs_camera_up{camera="cli-cam"} 1.0' in text
        assert 'vs_frames_enqueued_total{camera="cli-cam"}' in text
        assert "vs_detector_batch_seconds_count" in text
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        kill_group(proc, signal.SIGKILL)
    log = (tmp_path / "log").read_text()
    assert "event=pipeline_stopped" in log and "camera=cli-cam" in log
    assert read_stats(client, config.queue)["enqueued"] == client.xlen(config.queue.frames_stream)


@pytest.mark.timeout(60)
def test_describe_command_describes_and_stops_on_sigterm(
    redis_server, vlm_double, make_config, tmp_path: Path
):
    config = make_config(redis_server.url, describer={"base_url": vlm_double.base_url})
    enqueue_frames(redis_server.url, config.queue, 3)
    port = free_port()
    path = write_config(tmp_path / "cameras.yaml", config)
    proc = start(["describe", "--config", str(path), "--metrics-port", str(port)], tmp_path / "log")
    client = redis_server.client()
    try:
        wait_until(lambda: len(descriptions(client, config.queue)) == 3, 30, what="described")
        text = wait_until(lambda: metrics_text(port), 10, what="/metrics")
        assert 'vs_describe_frames_total{camera="cam",outcome="described",reason="ok"} 3.0' in text
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        kill_group(proc, signal.SIGKILL)
    assert pending_count(client, config.queue) == 0
    assert "event=describer_stopped" in (tmp_path / "log").read_text()


def test_missing_weights_exit_with_a_clear_error(make_config, tmp_path: Path) -> None:
    config = make_config(
        "redis://127.0.0.1:1/0",
        cameras=[{"id": "c", "url": "rtsp://127.0.0.1:1/x"}],
        detector={"weights": str(tmp_path / "yolo26n.pt")},
    )
    path = write_config(tmp_path / "cameras.yaml", config)
    done = subprocess.run(
        [*CLI, "pipeline", "--config", str(path)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "detector.weights" in done.stderr and ".yaml" in done.stderr


def test_invalid_config_exits_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "cameras.yaml"
    path.write_text("cameras:\n  - {id: a, url: 'rtsp://x', fps: -2}\n")
    done = subprocess.run(
        [*CLI, "describe", "--config", str(path)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2 and "cameras.0.fps" in done.stderr
