"""Faults injected into a running camera stack: afterwards every frame has exactly one outcome.

The stack is real processes: redis-server (AOF, appendfsync always), ``vision-serve
pipeline`` on a looping video file (RTSP for the source-drop test) with the untrained YOLO26n
and a gate that passes every frame, and ``vision-serve describe`` workers. The VLM is the
recording double (the engine is not what is under test here). Each test injects one fault
mid-run, checks the accounting identity while the stack recovers, lets the run settle --
pipeline stopped cleanly, describers drained -- and then checks that the identity
(``pipelines.queue.IDENTITY``) holds and that no frame was described twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipelines.queue import accounting
from tests.pipelines.pipeline_helpers import (
    REPO,
    RedisServer,
    RtspServer,
    VLMDouble,
    build_config,
    described_per_frame,
    kill_group,
    wait_until,
    write_config,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

CLI = [sys.executable, "-m", "vision_serve.cli"]
STARTUP_S = 90  # a pipeline process imports torch and builds the detector: slow on 2 cores


class Stack:
    """The processes of one run, each of which a test may kill, and the checks after it."""

    def __init__(self, tmp_path: Path, redis_server: RedisServer, source: str) -> None:
        self.tmp = tmp_path
        self.redis = redis_server
        self.vlm = VLMDouble().__enter__()
        self.vlm_port = self.vlm.server.server_address[1]
        self.config = build_config(
            redis_server.url,
            cameras=[{"id": "cam", "url": source, "fps": 3}],
            gate={"min_persons": 0, "cooldown_s": 0, "min_interval_s": 0.3},
            queue={"instance": "faults", "local_buffer": 2},
            describer={"base_url": self.vlm.base_url, "concurrency": 2},
        )
        self.q = self.config.queue
        self.path = write_config(tmp_path / "cameras.yaml", self.config)
        self.procs: list[subprocess.Popen] = []

    # -- processes -------------------------------------------------------------------------
    def _start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.tmp / f"{name}.log", "w") as out:
            proc = subprocess.Popen(
                [*CLI, *args, "--config", str(self.path)],
                cwd=REPO,
                start_new_session=True,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    def pipeline(self, name: str = "pipeline") -> subprocess.Popen:
        return self._start(name, "pipeline")

    def describer(self, consumer: str) -> subprocess.Popen:
        return self._start(f"describe-{consumer}", "describe", "--consumer", consumer)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def restart_vlm(self, down_for: float) -> None:
        """Kill the endpoint (port closed, connections dropped); bring it back on its port."""
        self.vlm.__exit__(None, None, None)
        time.sleep(down_for)
        self.vlm = VLMDouble(port=self.vlm_port).__enter__()

    def close(self) -> None:
        for proc in self.procs:
            kill_group(proc, signal.SIGKILL)
        self.vlm.__exit__(None, None, None)

    # -- observing -------------------------------------------------------------------------
    def client(self) -> redis.Redis:
        return self.redis.client()

    def described(self) -> int:
        try:
            return self.client().xlen(self.q.descriptions_stream)
        except redis.ConnectionError:
            return 0

    def wait_described(self, more: int, timeout: float = 60) -> None:
        """Wait until ``more`` frames beyond those described now are described."""
        target = self.described() + more
        wait_until(lambda: self.described() >= target, timeout, 0.2, what=f"{target} described")

    def held_by(self, consumer: str) -> int:
        summary = self.client().xpending(self.q.frames_stream, self.q.group)
        return sum(c["pending"] for c in summary["consumers"] if c["name"] == consumer.encode())

    def accounting(self) -> dict[str, Any]:
        return accounting(self.client(), self.q)

    def assert_identity(self) -> None:
        """The identity holds at any instant, not only when the queue is idle."""
        acc = self.accounting()
        assert acc["holds"], acc

    # -- the end of a run ------------------------------------------------------------------
    def settle(self, pipeline: subprocess.Popen, describers: list[subprocess.Popen]) -> None:
        """Stop the pipeline cleanly, let the describers drain the queue, stop them."""
        os.killpg(pipeline.pid, signal.SIGTERM)
        assert pipeline.wait(30) == 0
        wait_until(lambda: self.accounting()["pending"] == 0, 60, 0.2, what="queue drained")
        for proc in describers:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in describers:
            assert proc.wait(20) == 0

    def check(self) -> dict[str, Any]:
        """Every enqueued frame has one outcome; no frame has two results."""
        client = self.client()
        acc = self.accounting()
        assert acc["holds"], acc
        assert acc["pending"] == 0 and acc["described"] > 0, acc
        per_frame = described_per_frame(client, self.q)
        twice = sorted(uid for uid, n in per_frame.items() if n > 1)
        assert not twice, f"described more than once: {twice}"
        assert acc["described"] == client.xlen(self.q.descriptions_stream)
        assert acc["dead"] == client.xlen(self.q.dead_letter_stream)
        assert acc["producers"] == {}, "a clean stop leaves no producer record"
        for path in self.tmp.glob("*.log"):
            assert "Traceback" not in path.read_text(), path.read_text()[-3000:]
        return acc


@pytest.fixture
def stack(tmp_path: Path, redis_server: RedisServer, video_file: Path) -> Iterator[Stack]:
    run = Stack(tmp_path, redis_server, str(video_file))
    try:
        yield run
    finally:
        run.close()


def test_describer_killed_mid_frame_and_restarted(stack: Stack) -> None:
    stack.vlm.delay = 1.0  # slow answers: the worker always holds frames
    pipeline, first = stack.pipeline(), stack.describer("A")
    stack.wait_described(2, STARTUP_S)
    wait_until(lambda: stack.held_by("A") > 0, 10, what="A holds frames")
    kill_group(first, signal.SIGKILL)
    assert stack.held_by("A") > 0
    stack.vlm.delay = 0.0
    second = stack.describer("B")
    wait_until(lambda: stack.held_by("A") == 0, 30, 0.2, what="B reclaimed A's frames")
    stack.wait_described(3)
    stack.assert_identity()
    stack.settle(pipeline, [second])
    stack.check()
    assert "event=frame_reclaimed" in stack.log("describe-B")


def test_redis_killed_and_restarted(stack: Stack) -> None:
    assert stack.redis.FSYNC_POLICY == "always"
    pipeline, worker = stack.pipeline(), stack.describer("A")
    stack.wait_described(3, STARTUP_S)
    stack.redis.restart(signal.SIGKILL, down_for=2.0)
    stack.wait_described(3)
    stack.assert_identity()
    stack.settle(pipeline, [worker])
    acc = stack.check()
    # the pipeline's buffer (2) overflowed while Redis was down: counted, and in Redis now
    assert acc["not_enqueued"].get("dropped:buffer_full", 0) > 0, acc


def test_vlm_endpoint_killed_and_restarted(stack: Stack) -> None:
    pipeline, worker = stack.pipeline(), stack.describer("A")
    stack.wait_described(3, STARTUP_S)
    stack.restart_vlm(down_for=3.0)
    stack.wait_described(3)
    stack.assert_identity()
    stack.settle(pipeline, [worker])
    acc = stack.check()
    assert acc["dead"] == 0 and acc["expired"] == 0, "an outage is no frame's fault"
    log = stack.log("describe-A")
    # the endpoint pool logs the outage and the recovery of the one endpoint
    assert "event=endpoint_down" in log and "event=endpoint_up" in log


def test_rtsp_source_dropped_and_back(
    tmp_path: Path, redis_server: RedisServer, video_frames: Path
) -> None:
    camera = RtspServer(video_frames)
    camera.start()
    run = Stack(tmp_path, redis_server, camera.url)
    try:
        pipeline, worker = run.pipeline(), run.describer("A")
        run.wait_described(3, STARTUP_S)
        camera.stop()
        time.sleep(2.0)
        camera.start()  # same port
        run.wait_described(3)
        run.assert_identity()
        run.settle(pipeline, [worker])
        run.check()
        assert "event=camera_reconnect" in run.log("pipeline")
    finally:
        run.close()
        camera.stop()


def test_pipeline_killed_and_restarted(stack: Stack) -> None:
    first, worker = stack.pipeline("pipeline-1"), stack.describer("A")
    stack.wait_described(3, STARTUP_S)
    client = stack.client()
    key = f"{stack.q.producer_prefix}faults"
    old_run = client.hget(key, "run")
    assert old_run
    kill_group(first, signal.SIGKILL)
    record = client.hgetall(key)  # the trace a SIGKILL leaves: what it still held
    assert record[b"run"] == old_run
    held = int(record[b"buffered"])
    second = stack.pipeline("pipeline-2")
    wait_until(lambda: client.hget(key, "run") not in (None, old_run), STARTUP_S, what="new run")
    stack.wait_described(3)
    stack.assert_identity()
    stack.settle(second, [worker])
    acc = stack.check()
    assert acc["counters"].get("lost:crash", 0) == held
    runs = {uid.split(":")[1] for uid in described_per_frame(client, stack.q)}
    assert len(runs) == 2 and old_run.decode() in runs  # both runs' frames, none twice
