"""Two real engine replicas behind the describers: one is SIGKILLed mid-run, then restarted.

Specification (issue #19, "past one box"): every frame is still accounted for
(``enqueued == described + expired + dead + pending``), none is described twice, the
surviving replica takes the rest, and the killed one is used again once it is back.
Both replicas are ``vision-serve serve`` on loopback with the tiny checkpoint; the describers
talk to them through the ``openai`` SDK and to a real redis-server.
"""

from __future__ import annotations

import signal
import sys
from collections import Counter
from pathlib import Path

import pytest
from pipeline_helpers import (
    DescriberThread,
    ServerProcess,
    described_per_frame,
    descriptions,
    enqueue_frames,
    free_port,
    kill_group,
    spawn_logged,
    wait_healthy,
    wait_until,
)

from pipelines import metrics
from pipelines.queue import accounting

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class EngineServer(ServerProcess):
    """``vision-serve serve`` on a fixed loopback port (kept across restarts)."""

    def __init__(self, model: Path, log_path: Path) -> None:
        self.model = model
        self.log_path = log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.name = f"127.0.0.1:{self.port}"

    def spawn(self) -> None:
        cmd = [sys.executable, "-m", "vision_serve.cli", "serve", "--model", str(self.model)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "tiny"]
        cmd += ["--num-threads", "1"]  # two replicas share the test machine's cores
        self.proc = spawn_logged(cmd, self.log_path, mode="a")

    def wait(self) -> None:
        health = f"http://127.0.0.1:{self.port}/health"
        wait_healthy(self.proc, health, self.log_path, "vision-serve serve", 180, interval=0.3)

    def start(self) -> None:
        self.spawn()
        self.wait()


def requests_to(endpoint: str, outcome: str) -> float:
    return metrics.ENDPOINT_REQUESTS.labels(endpoint, outcome)._value.get()


def by_endpoint(client, q) -> Counter[str]:
    return Counter(d["endpoint"] for d in descriptions(client, q))


def test_a_killed_replica_loses_no_frame_and_is_used_again_after_its_restart(
    tiny_qwen2_vl, redis_server, make_config, tmp_path
):
    a = EngineServer(tiny_qwen2_vl, tmp_path / "a.log")
    b = EngineServer(tiny_qwen2_vl, tmp_path / "b.log")
    for server in (a, b):  # both load at once
        server.spawn()
    workers: list[DescriberThread] = []
    try:
        for server in (a, b):
            server.wait()
        config = make_config(
            redis_server.url,
            describer={
                "endpoints": [{"base_url": a.base_url}, {"base_url": b.base_url}],
                "concurrency": 3,
                "max_tokens": 24,
                "probe_interval_s": 0.5,
            },
        )
        q = config.queue
        client = redis_server.client()
        n = 40
        enqueue_frames(redis_server.url, q, n)
        workers = [DescriberThread(config, f"w{i}").start() for i in (1, 2)]
        pool = workers[0].describer.pool
        [ep_a] = [ep for ep in pool.endpoints if ep.name == a.name]

        # kill A while it is working on frames (SIGKILL: no goodbye on its connections)
        wait_until(lambda: by_endpoint(client, q)[a.name] >= 3, 60, what="A describes")
        wait_until(lambda: ep_a.inflight > 0, 30, interval=0.005, what="A has frames")
        kill_group(a.proc, signal.SIGKILL)
        a.proc = None
        answered_by_a = requests_to(a.name, "ok")

        wait_until(lambda: len(descriptions(client, q)) == n, 90, what=f"{n} described")
        state = accounting(client, q)
        assert state["holds"] and state["unaccounted"] == 0, state
        assert state["described"] == n and state["pending"] == 0
        assert state["expired"] == 0 and state["dead"] == 0, state
        per_frame = described_per_frame(client, q)
        assert len(per_frame) == n and set(per_frame.values()) == {1}  # none twice
        assert "duplicate_discarded" not in state["counters"]
        # the frames A had open failed over (not counted against them); A answered nothing
        # after its death, so B described every other frame
        assert requests_to(a.name, "unavailable") >= 1
        assert requests_to(a.name, "ok") == answered_by_a
        done = by_endpoint(client, q)
        assert done[a.name] == answered_by_a and done[b.name] == n - answered_by_a
        assert not ep_a.up and metrics.ENDPOINT_UP.labels(a.name)._value.get() == 0

        # A restarts on the same port: its health probe puts it back, and it is used again
        a.start()
        for worker in workers:
            wait_until(
                lambda w=worker: all(ep.up for ep in w.describer.pool.endpoints),
                30,
                what="A back in rotation",
            )
        enqueue_frames(redis_server.url, q, 12, camera="after")
        wait_until(lambda: len(descriptions(client, q)) == n + 12, 60, what="12 more described")
        after = [d for d in descriptions(client, q) if d["camera"] == "after"]
        assert {d["endpoint"] for d in after} == {a.name, b.name}
        state = accounting(client, q)
        assert state["holds"] and state["described"] == n + 12 and state["pending"] == 0
    finally:
        for worker in workers:
            worker.stop()
        a.stop()
        b.stop()
