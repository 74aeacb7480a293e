"""Real services for the events tests: descriptions written the way describers write them,
the ui in-process (real uvicorn on loopback) or as a ``vision-serve ui`` process.

Descriptions go through the real path up to the VLM call: frames are enqueued by the
pipeline's ``FrameQueue`` (JPEG key with its TTL, stream entry, accounting), read by the
describers' consumer group and committed with ``COMMIT_LUA`` carrying the fields
``pipelines/describe.py`` writes. Only the text is chosen by the test.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cv2
import httpx
import numpy as np
import redis

from pipelines.queue import COMMIT_LUA
from tests.pipelines.pipeline_helpers import (
    build_config,
    free_port,
    kill_group,
    spawn_logged,
    wait_healthy,
    wait_until,
    write_config,
)

API_KEY = "test-ui-key-0123456789"
BOX = (20.0, 16.0, 90.0, 110.0)


def make_config(redis_url: str, data_dir: Path, **sections: Any) -> Any:
    """A PipelineConfig with test-sized timings for the consumer, retention and streams."""
    events = {
        "data_dir": str(data_dir),
        "block_ms": 100,
        "claim_idle_s": 1,
        "claim_interval_s": 0.5,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.5,
        "retention_interval_s": 0.2,
        **sections.pop("events", {}),
    }
    ui = {"api_key": API_KEY, "sse_heartbeat_s": 0.5, **sections.pop("ui", {})}
    return build_config(redis_url, events=events, ui=ui, **sections)


def scene(seed: int = 0, size: tuple[int, int] = (160, 120)) -> np.ndarray:
    """A small BGR frame: a gradient with a 'person' block where ``BOX`` is."""
    width, height = size
    ramp = np.linspace(40, 200, width, dtype=np.uint8)
    image = np.dstack([np.tile(ramp, (height, 1))] * 3).copy()
    image[..., seed % 3] //= 2
    x1, y1, x2, y2 = (int(v) for v in BOX)
    image[y1:y2, x1:x2] = (60, 60, 160)
    return image


def enqueue(
    config: Any, images: list[np.ndarray], camera: str, boxes: list[tuple[float, ...]] | None = None
) -> None:
    """Frames through the real producer (each call is a new pipeline run: new frame_uids),
    each with ``boxes`` as its person detections (default: ``BOX``)."""
    from pipelines.detect import Detection
    from pipelines.ingest import Frame
    from pipelines.queue import FrameQueue, Outgoing

    drops: list[str] = []
    queue = FrameQueue(config.redis_url, config.queue, on_drop=lambda _c, r: drops.append(r))
    queue.start()
    dets = [Detection(0, "person", 0.9, box) for box in boxes or [BOX]]
    for seq, image in enumerate(images, 1):
        queue.submit(Outgoing(Frame(camera, seq, time.time(), image), dets, "first"))
    wait_until(lambda: queue.enqueued + len(drops) == len(images), 10, what="frames enqueued")
    queue.stop(flush_timeout=1)
    assert not drops, drops


def describe(
    config: Any,
    texts: list[str],
    camera: str = "door",
    *,
    ts: float | None = None,
    images: list[np.ndarray] | None = None,
    boxes: list[tuple[float, ...]] | None = None,
    worker: str = "test-describer",
) -> list[str]:
    """Enqueue one frame per text and commit each as described; returns their frame_uids.

    ``ts`` overrides the capture time written into the description (old events for the
    retention tests: the producer itself refuses frames older than ``max_frame_age_s``).
    """
    q = config.queue
    images = images or [scene(i) for i in range(len(texts))]
    enqueue(config, images, camera, boxes)
    client = redis.Redis.from_url(config.redis_url)
    commit = client.register_script(COMMIT_LUA)
    reply = client.xreadgroup(q.group, worker, {q.frames_stream: ">"}, count=len(texts))
    entries = reply[0][1]
    assert len(entries) == len(texts), entries
    uids = []
    for (raw_id, raw), text in zip(entries, texts, strict=True):
        entry_id = raw_id.decode()
        f = {k.decode(): v.decode() for k, v in raw.items()}
        now = time.time()
        captured = ts if ts is not None else float(f["ts"])
        result = {
            "frame_id": entry_id,
            "frame_uid": f["frame_uid"],
            "camera": f["camera"],
            "ts": f"{captured:.6f}",
            "described_at": f"{now:.6f}",
            "latency_s": f"{now - captured:.3f}",
            "text": text,
            "model": "tiny",
            "completion_tokens": "3",
            "vlm_seconds": "0.010",
            "persons": f["persons"],
            "boxes": f["boxes"],
            "image": f["image"],
            "worker": worker,
        }
        args: list[str] = [q.group, entry_id, "described", "described", str(q.descriptions_maxlen)]
        for key, value in result.items():
            args += [key, value]
        keys = [q.frames_stream, q.descriptions_stream, f"{q.latest_prefix}{camera}", q.stats_key]
        assert commit(keys=keys, args=args) == 1
        uids.append(f["frame_uid"])
    client.close()
    return uids


class UIServer:
    """``create_app`` under real uvicorn on a loopback port, in a thread of this process."""

    def __init__(self, config: Any) -> None:
        import uvicorn

        from pipelines.events.app import create_app

        self.config = config
        self.app = create_app(config)
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                timeout_graceful_shutdown=1,
            )
        )
        self.thread = threading.Thread(target=self.server.run, name="ui-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def store(self) -> Any:
        return self.app.state.store

    def start(self) -> UIServer:
        self.thread.start()
        wait_until(lambda: self.server.started, 10, what="ui server started")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive(), "ui server did not stop"


class UIProcess:
    """``vision-serve ui`` as its own process (killed with SIGKILL in the restart test)."""

    def __init__(self, config: Any, workdir: Path) -> None:
        self.config_path = write_config(workdir / "cameras.yaml", config)
        self.log_path = workdir / "ui.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> UIProcess:
        cmd = [sys.executable, "-m", "vision_serve.cli", "ui", "--config", str(self.config_path)]
        cmd += ["--port", str(self.port)]
        self.proc = spawn_logged(cmd, self.log_path, mode="a")
        wait_healthy(self.proc, f"{self.url}/health", self.log_path, "vision-serve ui", 30, 0.1)
        return self

    def stop(self, sig: int = 15) -> None:
        if self.proc is not None:
            kill_group(self.proc, sig)
            self.proc = None


def get(base: str, path: str, key: str | None = API_KEY, **params: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{base}{path}", params=params, headers=headers, timeout=10)


def event_ids(base: str, **params: Any) -> list[str]:
    """Every event id the API lists (all pages)."""
    ids: list[str] = []
    before = None
    while True:
        extra = {"before": before} if before else {}
        page = get(base, "/api/events", limit=200, **params, **extra)
        assert page.status_code == 200, page.text
        body = page.json()
        ids += [e["id"] for e in body["data"]]
        before = body["next"]
        if not before:
            return ids


def decode_jpeg(data: bytes) -> np.ndarray:
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert image is not None, "not a JPEG"
    return image


class PipelineRunner:
    """The real ``CameraPipeline`` (camera readers, the untrained YOLO26n, gate, producer)
    on a thread, for the live numbers it writes to Redis; ``stop()`` is a clean shutdown."""

    def __init__(self, config: Any) -> None:
        from pipelines.detect import Detector
        from pipelines.pipeline import CameraPipeline

        self.pipeline = CameraPipeline(config, Detector(config.detector))
        self.thread = threading.Thread(target=self.pipeline.run, name="pipeline", daemon=True)

    def start(self) -> PipelineRunner:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.pipeline.stop()
        self.thread.join(20)
        assert not self.thread.is_alive(), "pipeline did not stop"

    def __enter__(self) -> PipelineRunner:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        if self.thread.is_alive():
            self.stop()


def live_config(redis_url: str, data_dir: Path, video: Path, camera: str = "yard") -> Any:
    """One file camera whose every sampled frame passes the gate (``min_persons: 0``), a
    frames stream of ``maxlen`` 10 that nobody drains (so the rest are refused and counted
    ``queue_full``), live numbers every 0.2 s (TTL 0.6 s)."""
    return make_config(
        redis_url,
        data_dir,
        cameras=[{"id": camera, "url": str(video), "fps": 5}],
        detector={"weights": "yolo26n.yaml", "imgsz": 64},
        gate={"min_persons": 0, "cooldown_s": 0, "min_interval_s": 0},
        queue={"maxlen": 10, "heartbeat_s": 0.2},
    )
