"""Redis Streams: the hand-off between the pipeline and the describers.

Layout (names from ``QueueConfig``):

- ``frames`` stream: one entry per gated frame -- camera, capture time, boxes and the key
  of its JPEG. Consumed by the ``describers`` group (created from id 0, so frames enqueued
  before any describer started are not skipped).
- ``frame:<uuid>`` string: the JPEG itself, with a TTL, so a stream that nobody drains
  cannot hold gigabytes of images.
- ``descriptions`` stream and ``latest:<camera>`` hash: results.
- ``frames:dead`` stream: frames given up on, with the reason.
- ``stats`` hash: cluster-wide counters (enqueued, trimmed, refused, described,
  expired:<reason>, dead:<reason>, duplicate_discarded, lost:<reason>).

Both writes are Lua scripts, so each is atomic and survives a Redis restart as a whole
(with AOF). Enqueue refuses -- counted -- when the group's undelivered backlog reaches
``maxlen``; that keeps ``XADD MAXLEN ~`` trimming to entries already handed to a describer,
so trimming never destroys an unseen frame. Commit acknowledges and records in one step,
gated on ``XACK`` returning 1: of two workers that described the same frame, only the first
result is stored, so a frame is never described twice after acknowledgement.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cv2
import redis

from pipelines import metrics
from pipelines.backoff import Backoff
from pipelines.config import QueueConfig
from pipelines.detect import Detection
from pipelines.ingest import Frame
from pipelines.logs import kv

log = logging.getLogger(__name__)

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)

ENQUEUE_LUA = """
-- KEYS: frames stream, image key, stats hash
-- ARGV: jpeg, ttl seconds, maxlen, group, then field/value pairs of the entry
local stream, maxlen, group = KEYS[1], tonumber(ARGV[3]), ARGV[4]
local found, lag, last = false, false, '0-0'
if redis.call('EXISTS', stream) == 1 then
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == group then
      found, lag, last = true, info['lag'], info['last-delivered-id']
    end
  end
end
if not found then
  redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
  lag, last = false, '0-0'
end
if not lag then  -- unknown (Redis < 7, or deletions): count what the group has not seen
  lag = #redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', maxlen)
end
if lag >= maxlen then
  redis.call('HINCRBY', KEYS[3], 'refused_queue_full', 1)
  return {'', 0}
end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
local before = redis.call('XLEN', stream)
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', unpack(fields))
local trimmed = before + 1 - redis.call('XLEN', stream)
redis.call('HINCRBY', KEYS[3], 'enqueued', 1)
if trimmed > 0 then redis.call('HINCRBY', KEYS[3], 'trimmed', trimmed) end
return {id, trimmed}
"""

COMMIT_LUA = """
-- KEYS: frames stream, output stream, latest hash, stats hash, image key
-- ARGV: group, entry id, outcome (described|dead|expired), stats field, output maxlen,
--       then field/value pairs of the output entry
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  redis.call('HINCRBY', KEYS[4], 'duplicate_discarded', 1)
  return 0
end
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
if ARGV[3] == 'described' or ARGV[3] == 'dead' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', unpack(fields))
end
if ARGV[3] == 'described' then
  redis.call('HSET', KEYS[3], unpack(fields))
end
redis.call('HINCRBY', KEYS[4], ARGV[4], 1)
if KEYS[5] ~= '' then redis.call('DEL', KEYS[5]) end
return 1
"""


def connect(url: str, block_ms: int = 0) -> redis.Redis:
    """A client whose reads outlive an ``XREADGROUP BLOCK`` but not a dead server."""
    return redis.Redis.from_url(
        url,
        socket_timeout=max(5.0, block_ms / 1000 + 5.0),
        socket_connect_timeout=2.0,
        health_check_interval=15,
    )


def ensure_group(client: redis.Redis, cfg: QueueConfig) -> None:
    """Create the consumer group from id 0 (and the stream) unless it exists."""
    try:
        client.xgroup_create(cfg.frames_stream, cfg.group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def read_stats(client: redis.Redis, cfg: QueueConfig) -> dict[str, int]:
    """The cluster-wide counters of the stats hash."""
    raw = client.hgetall(cfg.stats_key)
    return {k.decode(): int(v) for k, v in raw.items()}


def queue_depth(client: redis.Redis, cfg: QueueConfig) -> dict[str, Any]:
    """Undelivered entries (lag), pending entries and the age of the oldest undelivered."""
    out: dict[str, Any] = {"lag": 0, "pending": 0, "lag_seconds": 0.0}
    try:
        groups = client.xinfo_groups(cfg.frames_stream)
    except redis.ResponseError:  # no stream yet
        return out
    for g in groups:
        name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
        if name != cfg.group:
            continue
        last = g["last-delivered-id"]
        last = last.decode() if isinstance(last, bytes) else last
        out["pending"] = int(g.get("pending", 0))
        head = client.xrange(cfg.frames_stream, min=f"({last}", max="+", count=1)
        lag = g.get("lag")
        if lag is None:
            lag = len(client.xrange(cfg.frames_stream, min=f"({last}", max="+", count=10_000))
        out["lag"] = int(lag)
        if head:
            ts = float(head[0][1].get(b"ts", b"0"))
            out["lag_seconds"] = max(0.0, time.time() - ts) if ts else 0.0
    return out


@dataclass
class Outgoing:
    """A gated frame on its way to Redis."""

    frame: Frame
    detections: list[Detection]
    gate_reason: str


def encode_entry(item: Outgoing, cfg: QueueConfig) -> tuple[bytes, dict[str, str]]:
    """JPEG bytes (downscaled to ``max_image_side``) and the stream entry's fields.

    Boxes are scaled with the image, so they match the JPEG the describer sends.
    """
    image = item.frame.image
    height, width = image.shape[:2]
    scale = min(1.0, cfg.max_image_side / max(height, width))
    if scale < 1.0:
        width, height = round(width * scale), round(height * scale)
        image = cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)
    ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, cfg.jpeg_quality])
    if not ok:
        raise ValueError("JPEG encoding failed")
    boxes = []
    for det in item.detections:
        d = det.to_dict()
        d["box"] = [round(v * scale, 1) for v in det.box]
        boxes.append(d)
    fields = {
        "camera": item.frame.camera_id,
        "ts": f"{item.frame.ts:.6f}",
        "seq": str(item.frame.seq),
        "persons": str(len(item.detections)),
        "boxes": json.dumps(boxes, separators=(",", ":")),
        "width": str(width),
        "height": str(height),
        "gate": item.gate_reason,
    }
    return buf.tobytes(), fields


class FrameQueue:
    """Producer: a bounded local buffer drained into Redis by one thread.

    Why a buffer and a thread: the detector loop must never wait on Redis. While Redis is
    unreachable the newest ``local_buffer`` frames wait here (older ones are dropped,
    counted ``buffer_full``), frames older than ``max_frame_age_s`` are dropped as
    ``expired``, and the thread reconnects with backoff.
    """

    def __init__(
        self,
        redis_url: str,
        cfg: QueueConfig,
        on_drop: Callable[[str, str], None],
        client: redis.Redis | None = None,
    ) -> None:
        self.cfg = cfg
        self.client = client or connect(redis_url)
        self._enqueue = self.client.register_script(ENQUEUE_LUA)
        self._on_drop = on_drop  # (camera_id, reason)
        self._buffer: deque[Outgoing] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="enqueue", daemon=True)
        self.enqueued = 0
        self.trimmed = 0
        self.redis_errors = 0
        self.connected = False

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: Outgoing) -> None:
        """Queue a frame for Redis without blocking; the oldest is dropped when full."""
        with self._cond:
            if self._closing:
                self._on_drop(item.frame.camera_id, "shutdown_unsent")
                return
            if len(self._buffer) >= self.cfg.local_buffer:
                oldest = self._buffer.popleft()
                self._on_drop(oldest.frame.camera_id, "buffer_full")
            self._buffer.append(item)
            metrics.ENQUEUE_BUFFER.set(len(self._buffer))
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._buffer)

    def stop(self, flush_timeout: float = 5.0) -> None:
        """Stop accepting; send what is buffered for up to ``flush_timeout``; count the rest."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + flush_timeout
        while self.pending() and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(5.0)
        with self._cond:
            while self._buffer:
                self._on_drop(self._buffer.popleft().frame.camera_id, "shutdown_unsent")
            metrics.ENQUEUE_BUFFER.set(0)

    # -- the thread --------------------------------------------------------------------
    def _next(self) -> Outgoing | None:
        with self._cond:
            while not self._buffer and not self._stop.is_set():
                if self._closing:
                    return None
                self._cond.wait(0.5)
            if self._stop.is_set() or not self._buffer:
                return None
            item = self._buffer.popleft()
            metrics.ENQUEUE_BUFFER.set(len(self._buffer))
            return item

    def _requeue(self, item: Outgoing) -> None:
        with self._cond:
            if len(self._buffer) >= self.cfg.local_buffer:
                self._on_drop(item.frame.camera_id, "buffer_full")
            else:
                self._buffer.appendleft(item)
            metrics.ENQUEUE_BUFFER.set(len(self._buffer))

    def _run(self) -> None:
        backoff = Backoff(0.2, 5.0)
        while True:
            item = self._next()
            if item is None:
                if self._stop.is_set() or self._closing:
                    return
                continue
            camera = item.frame.camera_id
            if time.time() - item.frame.ts > self.cfg.max_frame_age_s:
                self._on_drop(camera, "expired")
                continue
            try:
                self._send(item)
                backoff.reset()
                if not self.connected:
                    log.info(kv("redis_connected", component="enqueue"))
                self.connected = True
            except REDIS_DOWN as exc:
                self.redis_errors += 1
                metrics.REDIS_ERRORS.labels("enqueue").inc()
                if self.connected or backoff.attempts == 0:
                    log.warning(kv("redis_unavailable", component="enqueue", error=exc))
                self.connected = False
                self._requeue(item)
                if backoff.wait(self._stop):
                    return
            except redis.RedisError as exc:  # e.g. OOM: Redis refuses writes
                log.warning(kv("frame_refused", camera=camera, error=exc))
                self._on_drop(camera, "redis_refused")
            except ValueError as exc:
                log.warning(kv("frame_unencodable", camera=camera, error=exc))
                self._on_drop(camera, "encode_failed")

    def _send(self, item: Outgoing) -> None:
        jpeg, fields = encode_entry(item, self.cfg)
        image_key = f"{self.cfg.image_prefix}{uuid.uuid4().hex}"
        fields["image"] = image_key
        args: list[Any] = [jpeg, self.cfg.image_ttl_s, self.cfg.maxlen, self.cfg.group]
        for key, value in fields.items():
            args += [key, value]
        entry_id, trimmed = self._enqueue(
            keys=[self.cfg.frames_stream, image_key, self.cfg.stats_key], args=args
        )
        camera = item.frame.camera_id
        if not entry_id:
            self._on_drop(camera, "queue_full")
            return
        self.enqueued += 1
        metrics.FRAMES_ENQUEUED.labels(camera).inc()
        if trimmed:
            self.trimmed += int(trimmed)
            metrics.QUEUE_TRIMMED.inc(int(trimmed))
        log.debug(
            kv("frame_enqueued", camera=camera, id=entry_id.decode(), persons=len(item.detections))
        )
