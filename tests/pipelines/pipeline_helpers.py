"""Real services for the pipeline tests: redis-server, a GStreamer RTSP server, a VLM double.

Each service starts as a real process on a free loopback port, waits until it answers, and
kills its whole process group afterwards. Redis runs with AOF ``appendonly yes`` and
``appendfsync always``: every write is fsynced before Redis replies, so a restart (even
SIGKILL) loses nothing that was acknowledged -- the restart tests rely on exactly that.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_AUTOINSTALL", "False")

import cv2
import numpy as np
import redis

REPO = Path(__file__).resolve().parents[2]
RTSP_SCRIPT = REPO / "scripts" / "rtsp_server.py"
SYSTEM_PYTHON = "/usr/bin/python3"
FRAME_SIZE = (640, 480)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Any, timeout: float, interval: float = 0.05, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Signal a process group, escalate to SIGKILL, and reap it."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


# --- Redis ---------------------------------------------------------------------------------
class RedisServer:
    """A private redis-server with AOF (appendfsync always) that tests may kill and restart."""

    FSYNC_POLICY = "always"

    def __init__(self, workdir: Path) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server not installed: run scripts/install-system-deps.sh")
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.dir),
                "--appendonly", "yes",
                "--appendfsync", self.FSYNC_POLICY,
                "--save", "",
                "--protected-mode", "no",
                "--logfile", str(self.dir / "redis.log"),
            ],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = self.client()

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"redis-server exited: {self.log_tail()}")
            try:
                # loading the AOF answers -LOADING: wait until the data is back
                return bool(client.ping()) and client.info("persistence")["loading"] == 0
            except (redis.ConnectionError, redis.BusyLoadingError):
                return False

        wait_until(ready, 15, what="redis-server ready")
        client.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            kill_group(self.proc, sig)
            self.proc = None

    def restart(self, sig: int = signal.SIGKILL, down_for: float = 0.0) -> None:
        """Kill (default: SIGKILL, no final save) and start again on the same port and data."""
        self.stop(sig)
        time.sleep(down_for)
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)

    def log_tail(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text()[-2000:] if path.exists() else "(no log)"


# --- RTSP ----------------------------------------------------------------------------------
def people_images() -> list[np.ndarray]:
    from ultralytics.utils import ASSETS

    return [cv2.resize(cv2.imread(str(ASSETS / n)), FRAME_SIZE) for n in ("bus.jpg", "zidane.jpg")]


def is_blank(image: np.ndarray) -> bool:
    """The test video's frames without people are flat grey; H.264 keeps them nearly so."""
    return float(image.std()) < 8.0


class RtspServer:
    """``scripts/rtsp_server.py`` under Debian's python3 (the only one with GStreamer's gi)."""

    def __init__(self, images: Path, fps: int = 5, mounts: tuple[str, ...] = ("/cam",)) -> None:
        if not Path(SYSTEM_PYTHON).exists() or shutil.which("gst-launch-1.0") is None:
            pytest.skip("GStreamer RTSP server missing: run scripts/install-system-deps.sh")
        self.images = images
        self.fps = fps
        self.mounts = mounts
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        return [f"rtsp://127.0.0.1:{self.port}{m}" for m in self.mounts]

    def start(self) -> None:
        cmd = [SYSTEM_PYTHON, str(RTSP_SCRIPT), "--port", str(self.port)]
        cmd += ["--images", str(self.images), "--fps", str(self.fps)]
        for mount in self.mounts:
            cmd += ["--mount", mount]
        self.proc = subprocess.Popen(
            cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        line = self.proc.stdout.readline()  # "READY rtsp://..." once listening
        if not line.startswith("READY"):
            rest = line + (self.proc.stdout.read() if self.proc.poll() is not None else "")
            self.stop()
            raise AssertionError(f"rtsp_server.py did not start: {rest}")
        # keep draining its output so a chatty GStreamer never blocks on a full pipe
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        wait_until(self._accepts, 10, what="RTSP port open")

    def _accepts(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            kill_group(self.proc, sig)
            self.proc = None


# --- detector ------------------------------------------------------------------------------
# --- VLM endpoints -------------------------------------------------------------------------
class VLMDouble:
    """A minimal OpenAI-compatible ``/v1/chat/completions`` for fault-injection tests only.

    Records every request; ``delay`` slows answers (to kill a describer mid-batch); ``status``
    makes it fail. Never used for the happy path -- that runs against ``vision-serve serve``.
    """

    def __init__(self, delay: float = 0.0, port: int = 0) -> None:
        self.delay = delay
        self.status = 200
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with double.lock:
                    double.requests.append(body)
                    n = len(double.requests)
                time.sleep(double.delay)
                if double.status != 200:
                    payload = {"error": {"message": "injected failure", "type": "test"}}
                    self._send(double.status, payload)
                    return
                text = f"double description #{n}"
                self._send(
                    200,
                    {
                        "id": f"chatcmpl-{n}",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": body.get("model", "double"),
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
                    },
                )

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> VLMDouble:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- configs -------------------------------------------------------------------------------
def write_config(path: Path, config: Any) -> Path:
    """Write a config as YAML for the CLI subprocess tests."""
    import yaml

    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


class DescriberThread:
    """Runs a ``Describer`` on its own event loop in a thread, as one in-process worker."""

    def __init__(self, config: Any, consumer: str) -> None:
        from pipelines.describe import Describer

        self.describer = Describer(config, consumer=consumer)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"describer-{consumer}", daemon=True)

    def _run(self) -> None:
        import asyncio

        try:
            asyncio.run(self.describer.run())
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def start(self) -> DescriberThread:
        self.thread.start()
        wait_until(lambda: self.describer._loop is not None, 5, what="describer loop")
        return self

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 15.0) -> None:
        self.describer.request_stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "describer did not stop"
        if self.error is not None:
            raise self.error


def enqueue_frames(redis_url: str, queue_cfg: Any, n: int, camera: str = "cam", age: float = 0.0):
    """Put ``n`` frames (random 64x64 JPEGs, one person box) through the real producer."""
    from pipelines.detect import Detection
    from pipelines.ingest import Frame
    from pipelines.queue import FrameQueue, Outgoing

    drops: list[str] = []
    queue = FrameQueue(redis_url, queue_cfg, on_drop=lambda _c, reason: drops.append(reason))
    queue.start()
    rng = np.random.default_rng(n)
    for i in range(n):
        image = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
        det = Detection(0, "person", 0.9, (1.0, 1.0, 20.0, 20.0))
        queue.submit(Outgoing(Frame(camera, i, time.time() - age, image), [det], "first"))
    wait_until(lambda: queue.enqueued + len(drops) == n, 10, what=f"{n} frames enqueued")
    queue.stop(flush_timeout=1)
    assert not drops, drops
    client = redis.Redis.from_url(redis_url)
    return [entry_id.decode() for entry_id, _ in client.xrange(queue_cfg.frames_stream)][-n:]


def descriptions(client: redis.Redis, queue_cfg: Any) -> list[dict[str, str]]:
    """Every entry of the descriptions stream, decoded."""
    out = []
    for _id, fields in client.xrange(queue_cfg.descriptions_stream):
        out.append({k.decode(): v.decode() for k, v in fields.items()})
    return out


def pending_count(client: redis.Redis, queue_cfg: Any) -> int:
    return int(client.xpending(queue_cfg.frames_stream, queue_cfg.group)["pending"])
