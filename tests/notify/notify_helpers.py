"""Real services for the notifier tests: a private Mosquitto broker (password file,
persistence), an MQTT subscriber that records everything, and a webhook receiver on loopback
that verifies each request's signature.

Redis and the rest come from ``tests/pipelines/pipeline_helpers.py``.
"""

from __future__ import annotations

import getpass
import json
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from tests.pipelines.pipeline_helpers import (
    ServerProcess,
    TlsFiles,
    WorkerThread,
    build_config,
    free_port,
    wait_until,
)

MQTT_USER = "notifier"
MQTT_PASSWORD = "mqtt-Pa55-" + uuid.uuid4().hex[:12]
WEBHOOK_SECRET = "hook-s3cret-" + uuid.uuid4().hex[:12]


# --- Mosquitto -----------------------------------------------------------------------------
class Mosquitto(ServerProcess):
    """``mosquitto`` on a free loopback port: no anonymous clients (a password file made with
    ``mosquitto_passwd``), persistence saved every second so a SIGKILL keeps sessions and
    retained messages; kill and restart it on the same port and data. ``tls``: TLS only."""

    def __init__(self, workdir: Path, tls: TlsFiles | None = None) -> None:
        if shutil.which("mosquitto") is None or shutil.which("mosquitto_passwd") is None:
            pytest.skip("mosquitto not installed: run scripts/install-system-deps.sh")
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        passwords = self.dir / "passwords"
        subprocess.run(
            ["mosquitto_passwd", "-c", "-b", str(passwords), MQTT_USER, MQTT_PASSWORD],
            check=True,
            capture_output=True,
            timeout=10,
        )
        passwords.chmod(0o600)
        self.conf = self.dir / "mosquitto.conf"
        self.conf.write_text(
            "\n".join(
                [
                    f"listener {self.port} 127.0.0.1",
                    *(
                        [f"cafile {tls.ca}", f"certfile {tls.cert}", f"keyfile {tls.key}"]
                        if tls
                        else []
                    ),
                    "allow_anonymous false",
                    f"password_file {passwords}",
                    "persistence true",
                    f"persistence_location {self.dir}/",
                    "autosave_interval 1",
                    f"log_dest file {self.dir}/mosquitto.log",
                    "log_type all",
                    # as root it would switch to the `mosquitto` user, which cannot read here
                    f"user {getpass.getuser()}",
                    "",
                ]
            )
        )

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["mosquitto", "-c", str(self.conf)],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"mosquitto exited: {self.proc.stderr.read()!r}")
            with socket.socket() as s:
                s.settimeout(0.5)
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_until(ready, 10, what="mosquitto listening")

    def saved_since(self, t: float) -> None:
        """Wait for an autosave after ``t``: what the broker held then survives a SIGKILL."""
        db = self.dir / "mosquitto.db"
        wait_until(lambda: db.exists() and db.stat().st_mtime > t, 10, what="autosave")

    def log(self) -> str:
        path = self.dir / "mosquitto.log"
        return path.read_text(errors="replace") if path.exists() else ""


@dataclass
class Received:
    topic: str
    payload: bytes
    retain: bool

    def json(self) -> Any:
        return json.loads(self.payload)


class Subscriber:
    """A paho client in its own thread recording every message under ``topics``. Its session
    is persistent (clean_session off, QoS 1) and it reconnects by itself, so messages
    published while it is away are queued by the broker for it."""

    def __init__(self, broker: Mosquitto, topics: tuple[str, ...] = ("#",), persistent=True):
        import paho.mqtt.client as mqtt

        self.topics = topics
        self.messages: list[Received] = []
        self.lock = threading.Lock()
        self.subscribed = threading.Event()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"test-sub-{uuid.uuid4().hex[:8]}",
            clean_session=not persistent,
        )
        self.client.username_pw_set(MQTT_USER, MQTT_PASSWORD)
        self.client.reconnect_delay_set(0.1, 0.5)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *_a: self.subscribed.set()
        self.client.on_message = self._on_message
        self.broker = broker

    def _on_connect(self, client: Any, _userdata: Any, _flags: Any, reason: Any, _p: Any) -> None:
        if not reason.is_failure:
            client.subscribe([(t, 1) for t in self.topics])

    def _on_message(self, _client: Any, _userdata: Any, message: Any) -> None:
        with self.lock:
            self.messages.append(Received(message.topic, bytes(message.payload), message.retain))

    def __enter__(self) -> Subscriber:
        self.client.connect("127.0.0.1", self.broker.port, keepalive=5)
        self.client.loop_start()
        assert self.subscribed.wait(10), "subscriber not subscribed"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def on(self, suffix: str) -> list[Received]:
        with self.lock:
            return [m for m in self.messages if m.topic.endswith(suffix)]

    def event_ids(self) -> Counter[str]:
        return Counter(m.json()["event_id"] for m in self.on("/event"))


def retained(broker: Mosquitto, topic: str = "#", settle: float = 1.0) -> dict[str, bytes]:
    """What the broker holds retained: a fresh clean-session client's retained messages."""
    sub = Subscriber(broker, (topic,), persistent=False)
    with sub:
        time.sleep(settle)
    return {m.topic: m.payload for m in sub.messages if m.retain}


# --- webhook receiver ----------------------------------------------------------------------
@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int
    verified: bool

    @property
    def event_id(self) -> str:
        return json.loads(self.body)["event_id"]


@dataclass
class Route:
    """Answers in order (then ``then``); ``delay`` before each answer."""

    answers: list[int] = field(default_factory=list)
    then: int = 200
    delay: float = 0.0


class WebhookReceiver:
    """A loopback HTTP server recording each POST (raw body + headers) and whether its
    ``X-Vision-Serve-Signature`` verifies with ``secret``. Routes are per path."""

    def __init__(self, secret: str = WEBHOOK_SECRET) -> None:
        from pipelines.notify.webhook import verify

        self.secret = secret
        self.routes: dict[str, Route] = {}
        self.hits: list[Hit] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                ok = verify(
                    receiver.secret,
                    body,
                    headers.get("x-vision-serve-signature"),
                    headers.get("x-vision-serve-timestamp"),
                    headers.get("x-vision-serve-event-id"),
                )
                with receiver.lock:
                    route = receiver.routes.setdefault(self.path, Route())
                    status = route.answers.pop(0) if route.answers else route.then
                    delay = route.delay
                time.sleep(delay)
                with receiver.lock:
                    receiver.hits.append(Hit(self.path, headers, body, status, ok))
                data = b'{"ok": true}' if status < 300 else b'{"error": "injected"}'
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the notifier was killed while waiting for this answer
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def route(self, path: str, *answers: int, then: int = 200, delay: float = 0.0) -> str:
        with self.lock:
            self.routes[path] = Route(list(answers), then, delay)
        return self.url(path)

    def on(self, path: str, status: int | None = None) -> list[Hit]:
        with self.lock:
            return [h for h in self.hits if h.path == path and status in (None, h.status)]

    def delivered_ids(self, path: str) -> Counter[str]:
        return Counter(h.event_id for h in self.on(path) if 200 <= h.status < 300)

    def __enter__(self) -> WebhookReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- descriptions and configs --------------------------------------------------------------
def add_descriptions(
    client: redis.Redis, queue_cfg: Any, n: int, camera: str = "cam", run: str | None = None
) -> list[str]:
    """``n`` described entries shaped as ``describe._finish`` writes them; their event ids."""
    run = run or uuid.uuid4().hex[:8]
    ids = []
    for seq in range(1, n + 1):
        now = time.time()
        uid = f"{camera}:{run}:{seq}"
        box = {"cls": 0, "label": "person", "conf": 0.9, "box": [1.0, 2.0, 30.0, 40.0]}
        client.xadd(
            queue_cfg.descriptions_stream,
            {
                "frame_id": f"{int(now * 1000)}-{seq}",
                "frame_uid": uid,
                "camera": camera,
                "ts": f"{now - 0.5:.6f}",
                "described_at": f"{now:.6f}",
                "latency_s": "0.500",
                "text": f"person {seq} at the door",
                "model": "tiny",
                "completion_tokens": "5",
                "vlm_seconds": "0.100",
                "persons": "1",
                "boxes": json.dumps([box]),
                "image": f"{queue_cfg.image_prefix}{uid}",
                "worker": "test",
            },
        )
        ids.append(uid)
    return ids


def add_expired(client: redis.Redis, queue_cfg: Any, camera: str = "cam") -> str:
    """An outcome without a text, as an expired frame's entry: the notifier skips it."""
    uid = f"{camera}:expired:{uuid.uuid4().hex[:6]}"
    client.xadd(
        queue_cfg.descriptions_stream,
        {"frame_id": "1-1", "frame_uid": uid, "camera": camera, "ts": f"{time.time():.6f}",
         "reason": "max_age", "detail": ""},
    )  # fmt: skip
    return uid


NOTIFY_TIMINGS = {
    "block_ms": 200,
    "claim_idle_s": 2,
    "claim_interval_s": 0.5,
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.3,
    "shutdown_grace_s": 2,
    "metrics_port": 0,
}


def notify_section(
    broker: Mosquitto | None = None, webhooks: list[dict[str, Any]] = (), **overrides: Any
) -> dict[str, Any]:
    section: dict[str, Any] = {**NOTIFY_TIMINGS, **overrides}
    if broker is not None:
        section["mqtt"] = {
            "host": "127.0.0.1",
            "port": broker.port,
            "username": MQTT_USER,
            "password": MQTT_PASSWORD,
            "keepalive_s": 5,
            "publish_timeout_s": 3,
        }
    section["webhooks"] = [
        {"secret": WEBHOOK_SECRET, "timeout_s": 3, "max_attempts": 5, **hook} for hook in webhooks
    ]
    return section


def notify_config(redis_url: str, cameras: tuple[str, ...] = ("cam",), **notify: Any) -> Any:
    cams = [{"id": c, "url": f"/videos/{c}.mp4"} for c in cameras]
    return build_config(redis_url, cameras=cams, notify=notify_section(**notify))


def write_raw_config(path: Path, redis_url: str, cameras=("cam",), **notify: Any) -> Path:
    """The YAML a person would write (secrets in clear: ``model_dump`` would mask them)."""
    data = {
        "redis_url": redis_url,
        "cameras": [{"id": c, "url": f"/videos/{c}.mp4"} for c in cameras],
        "notify": notify_section(**notify),
        "metrics": {"pipeline_port": 0, "describe_port": 0},
    }
    path.write_text(yaml.safe_dump(data))
    return path


class NotifierThread(WorkerThread):
    """A ``Notifier`` as one in-process notifier."""

    def __init__(self, config: Any, consumer: str = "test-notifier") -> None:
        from pipelines.notify.notifier import Notifier

        self.notifier = Notifier(config, consumer=consumer)
        super().__init__(self.notifier, "notifier", "notifier")


def group_state(client: redis.Redis, stream: str, group: str) -> dict[str, int] | None:
    """The group's pending and not-yet-read entries; None while it does not exist."""
    if not client.exists(stream):
        return None
    for g in client.xinfo_groups(stream):
        if g["name"].decode() == group:
            return {"pending": int(g["pending"]), "lag": int(g.get("lag") or 0)}
    return None


def stats(client: redis.Redis, key: str = "vs:notify:stats") -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(key).items()}


def settled(client: redis.Redis, stream: str, groups: list[str]) -> bool:
    """Every group has read and acknowledged everything."""
    return all(group_state(client, stream, g) == {"pending": 0, "lag": 0} for g in groups)
