"""Real services for the pipeline tests: redis-server, a GStreamer RTSP server, a VLM double.

Each service starts as a real process on a free loopback port, waits until it answers, and
kills its whole process group afterwards. Redis runs with AOF ``appendonly yes`` and
``appendfsync always``: every write is fsynced before Redis replies, so a restart (even
SIGKILL) loses nothing that was acknowledged -- the restart tests rely on exactly that.

The fixtures other test packages share (``redis_server``, ``video_frames``, ``video_file``)
are defined here once; a conftest re-exports one by importing it.
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
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import quote, urlencode

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


def spawn_logged(cmd: list[str], log_path: Path, mode: str = "w") -> subprocess.Popen:
    """Start ``cmd`` in the repo, in its own process group, stdout and stderr to ``log_path``."""
    with open(log_path, mode) as log_file:
        return subprocess.Popen(
            cmd, cwd=REPO, start_new_session=True, stdout=log_file, stderr=subprocess.STDOUT
        )


def wait_healthy(
    proc: subprocess.Popen, url: str, log_path: Path, what: str, timeout: float, interval: float
) -> None:
    """Poll ``url`` until it answers 200; fail with the log's tail if ``proc`` exits first."""
    import httpx

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited: {log_path.read_text()[-3000:]}")
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout, interval=interval, what=f"{what} {url}")


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


class ServerProcess:
    """A server run as its own process group: the subclass's ``start()`` returns once it
    answers; ``stop`` kills the group; ``with server:`` runs it for the block."""

    proc: subprocess.Popen | None = None

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            kill_group(self.proc, sig)
            self.proc = None

    def restart(self, sig: int = signal.SIGKILL, down_for: float = 0.0) -> None:
        """Kill (default: SIGKILL, no final save) and start again on the same port and data."""
        self.stop(sig)
        time.sleep(down_for)
        self.start()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# --- Redis ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS redis-server: its certificate and key, and the CA that signed it."""

    cert: Path
    key: Path
    ca: Path


def make_tls_files(d: Path, name: str) -> TlsFiles:
    """A throwaway CA (``ca.crt``, ``ca.key``) and a certificate it signed for 127.0.0.1 and
    localhost (``<name>.crt``, ``<name>.key``), in ``d``; EC keys: fast."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: cannot make a test certificate")

    def openssl(*args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", d / "ca.key", "-out", d / "ca.crt",
            "-days", "2", "-subj", "/CN=vision-serve test CA")  # fmt: skip
    openssl("req", *ec, "-keyout", d / f"{name}.key", "-out", d / f"{name}.csr",
            "-subj", "/CN=localhost")  # fmt: skip
    (d / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", d / f"{name}.csr", "-CA", d / "ca.crt", "-CAkey", d / "ca.key",
            "-CAcreateserial", "-out", d / f"{name}.crt", "-days", "2",
            "-extfile", d / "san.cnf")  # fmt: skip
    return TlsFiles(cert=d / f"{name}.crt", key=d / f"{name}.key", ca=d / "ca.crt")


class RedisServer(ServerProcess):
    """A private redis-server with AOF (appendfsync always) that tests may kill and restart.

    By default it needs no password. ``password`` alone sets the default user's password
    (``requirepass``); with ``user`` too, that ACL user (rules ``acl``) is the only one and the
    default user is off. ``tls`` serves TLS only (``rediss://``; clients need no certificate).
    ``url`` carries whatever a client needs to get in.
    """

    FSYNC_POLICY = "always"

    def __init__(
        self,
        workdir: Path,
        *,
        password: str | None = None,
        user: str | None = None,
        acl: str = "~* &* +@all",
        tls: TlsFiles | None = None,
    ) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server not installed: run scripts/install-system-deps.sh")
        if user is not None and password is None:
            raise ValueError("an ACL user needs a password")
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.password = password
        self.user = user
        self.acl = acl
        self.tls = tls
        self.url = self._url()

    def _url(self) -> str:
        auth = ""
        if self.password is not None:
            auth = f"{quote(self.user or '', safe='')}:{quote(self.password, safe='')}@"
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        query = urlencode({"ssl_cert_reqs": "required", "ssl_ca_certs": str(self.tls.ca)})
        return f"rediss://{auth}127.0.0.1:{self.port}/0?{query}"

    def _auth_args(self) -> list[str]:
        if self.password is None:
            return []
        if self.user is None:
            return ["--requirepass", self.password]
        return ["--user", self.user, "on", f">{self.password}", *self.acl.split(),
                "--user", "default", "off"]  # fmt: skip

    def _port_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        return [
            "--port", "0",
            "--tls-port", str(self.port),
            "--tls-cert-file", str(self.tls.cert),
            "--tls-key-file", str(self.tls.key),
            "--tls-ca-cert-file", str(self.tls.ca),
            "--tls-auth-clients", "no",
        ]  # fmt: skip

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                *self._port_args(),
                "--bind", "127.0.0.1",
                "--dir", str(self.dir),
                "--appendonly", "yes",
                "--appendfsync", self.FSYNC_POLICY,
                "--save", "",
                "--protected-mode", "no",
                "--logfile", str(self.dir / "redis.log"),
                *self._auth_args(),
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
            except redis.exceptions.NoPermissionError:  # an ACL user without INFO: PING must do
                return True
            except (redis.ConnectionError, redis.BusyLoadingError):
                return False

        wait_until(ready, 15, what="redis-server ready")
        client.close()

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


class RtspServer(ServerProcess):
    """``scripts/rtsp_server.py`` under Debian's python3 (the only one with GStreamer's gi)."""

    def __init__(self, images: Path, fps: int = 5, mounts: tuple[str, ...] = ("/cam",)) -> None:
        if not Path(SYSTEM_PYTHON).exists() or shutil.which("gst-launch-1.0") is None:
            pytest.skip("GStreamer RTSP server missing: run scripts/install-system-deps.sh")
        self.images = images
        self.fps = fps
        self.mounts = mounts
        self.port = free_port()

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
        self.connections: set[socket.socket] = set()
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with double.lock:
                    double.connections.add(self.connection)

            def finish(self) -> None:
                with double.lock:
                    double.connections.discard(self.connection)
                super().finish()

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
        """Stop like a killed server: the port closes and open (keep-alive) connections drop."""
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            open_connections = list(self.connections)
        for conn in open_connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


# --- configs -------------------------------------------------------------------------------
def write_config(path: Path, config: Any) -> Path:
    """Write a config as YAML for the CLI subprocess tests."""
    import yaml

    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


class WorkerThread:
    """A ``RedisWorker`` (describer, notifier) on its own event loop in a thread, as one
    in-process worker; ``kind`` names it in failures."""

    def __init__(self, worker: Any, kind: str, thread_name: str) -> None:
        self.worker = worker
        self.kind = kind
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _run(self) -> None:
        import asyncio

        try:
            asyncio.run(self.worker.run())
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def start(self) -> Self:
        self.thread.start()
        wait_until(lambda: self.worker._loop is not None, 5, what=f"{self.kind} loop")
        return self

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 15.0) -> None:
        self.worker.request_stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.kind} did not stop"
        if self.error is not None:
            raise self.error

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class DescriberThread(WorkerThread):
    """A ``Describer`` as one in-process worker."""

    def __init__(self, config: Any, consumer: str) -> None:
        from pipelines.describe import Describer

        self.describer = Describer(config, consumer=consumer)
        super().__init__(self.describer, "describer", f"describer-{consumer}")


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


def described_per_frame(client: redis.Redis, queue_cfg: Any) -> Counter[str]:
    """How many results (descriptions and dead letters) each ``frame_uid`` got: 1 each."""
    seen: Counter[str] = Counter()
    for stream in (queue_cfg.descriptions_stream, queue_cfg.dead_letter_stream):
        for _id, fields in client.xrange(stream):
            seen[fields.get(b"frame_uid", fields[b"frame_id"]).decode()] += 1
    return seen


# --- shared with tests/reliability (which imports this module as tests.pipelines.*) ---------
def build_config(redis_url: str, **sections: Any) -> Any:
    """A validated PipelineConfig with test-sized bounds and timings; ``sections`` override
    (a dict merges into the section's defaults here, anything else replaces it)."""
    from pipelines.config import parse_config

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


def write_video_frames(out: Path) -> Path:
    """A folder of numbered JPEGs: people (bus, zidane) alternating with empty grey frames."""
    bus, zidane = people_images()
    blank = np.full((FRAME_SIZE[1], FRAME_SIZE[0], 3), 96, np.uint8)
    for i, image in enumerate([bus, blank, zidane, blank]):
        cv2.imwrite(str(out / f"frame_{i:05d}.jpg"), image)
    return out


def write_video_file(frames: Path, path: Path) -> Path:
    """``frames`` as an MP4 file source (5 fps, 4 s), written with OpenCV."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 5.0, FRAME_SIZE)
    images = [cv2.imread(str(p)) for p in sorted(frames.glob("*.jpg"))]
    for _ in range(5):
        for image in images:
            writer.write(image)
    writer.release()
    return path


# --- fixtures shared with other test packages ----------------------------------------------
@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server without a password; for one with a password, an ACL user or TLS,
    ``with RedisServer(path, password=..., tls=...) as server``."""
    with RedisServer(tmp_path / "redis") as server:
        yield server


@pytest.fixture(scope="session")
def video_frames(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of numbered JPEGs: people (bus, zidane) alternating with empty grey frames."""
    return write_video_frames(tmp_path_factory.mktemp("frames"))


@pytest.fixture(scope="session")
def video_file(video_frames: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same frames as an MP4 file source (5 fps, 4 s), written with OpenCV."""
    return write_video_file(video_frames, tmp_path_factory.mktemp("video") / "people.mp4")


def iou(a: Any, b: Any) -> float:
    """Intersection over union of two (x1, y1, x2, y2) boxes."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union else 0.0


def wait_all_described(
    pipeline: Any, client: redis.Redis, queue_cfg: Any, timeout: float, what: str
) -> None:
    """Until every entry the pipeline enqueued has a description (at least one) and none is
    pending: the end of a pipeline -> describer run."""
    wait_until(
        lambda: (
            pipeline.queue.enqueued == len(descriptions(client, queue_cfg)) > 0
            and pending_count(client, queue_cfg) == 0
        ),
        timeout,
        what=what,
    )
