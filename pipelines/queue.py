"""Redis Streams: the hand-off between the pipeline and the describers.

Layout (names from ``QueueConfig``):

- ``frames`` stream: one entry per gated frame -- camera, capture time, boxes, ``frame_uid``
  and the key of its JPEG. Consumed by the ``describers`` group (created from id 0, so frames
  enqueued before any describer started are not skipped).
- ``frame:<frame_uid>`` string: the JPEG itself, with a TTL, so a stream that nobody drains
  cannot hold gigabytes of images.
- ``frame:<frame_uid>:clip`` string, for a clip (``describer.view: clip``) only: its JPEGs
  back to back, oldest first, at most ``max_clip_bytes``, with the same TTL; the entry names
  it in ``clip`` and gives each JPEG's length in ``clip_sizes`` (``encode_clip``). The
  ``image`` key then holds the clip's last frame: the event's snapshot. A worker deletes
  the clip key with its result.
- ``enqueued:<frame_uid>`` string: the stream entry id of an enqueued frame, kept as long as
  the frame may still be sent (``max(image_ttl_s, max_frame_age_s)``).
- ``descriptions`` stream and ``latest:<camera>`` hash: results. Each entry appended to
  the descriptions (or dead-letter) stream carries ``n``, its number in that stream (stats
  field ``appended:<stream>``), so a reader can count entries trimmed before it read them.
- ``frames:dead`` stream: frames given up on, with the reason.
- ``producer:<instance>`` hash: a running pipeline's ``run`` id, the frames it holds
  unsent (``buffered``) and its last ``heartbeat``.
- ``camera:<id>`` hash: the camera's live numbers from the pipeline that reads it
  (``CAMERA_FIELDS``), written every ``heartbeat_s`` with a TTL of three heartbeats: a
  pipeline that stopped or lost Redis leaves no frozen numbers, its cameras read as offline.
- ``stats`` hash: cluster-wide counters, below.

Frame identity: ``frame_uid = <camera>:<run>:<seq>``, where ``run`` is random per pipeline
process and ``seq`` the camera reader's sample number. A retried send keeps it; a restarted
pipeline, whose cameras count from 1 again, does not reuse it. Enqueue is idempotent per
``frame_uid``: a send whose reply was lost (socket timeout) and is retried finds its entry
and returns it (counted ``enqueue_duplicate``) instead of adding the frame twice.

Accounting: every enqueued frame has exactly one outcome, so at every instant

    enqueued == described + expired + dead + pending

- ``expired`` is the sum of ``expired:<reason>`` (``max_age``, ``image_gone``), ``dead`` the
  sum of ``dead:<reason>`` (``rejected``, ``server_error``, ``max_deliveries``,
  ``trimmed_pending``), and ``pending`` the entries in the group's pending list (delivered,
  not acknowledged) plus those not yet delivered.
- Both sides move together inside Lua scripts: enqueue adds the entry and counts it; commit
  acknowledges and counts the outcome, gated on ``XACK`` returning 1 (of two workers that
  described the same frame only the first result is stored; the other is counted
  ``duplicate_discarded``). ``accounting()`` reads both sides in one script.

Frames that never reach the stream are counted under their own names, outside the identity:
``refused_queue_full`` (the group's undelivered backlog is at ``maxlen``),
``dropped:<reason>`` (``buffer_full``, ``shutdown_unsent``, ``redis_refused``,
``encode_failed``, ``clip_too_large``, ``expired``) and ``lost:crash`` (frames a killed
pipeline held, from its producer record: its successor under the same instance name adds
them at start). Drops counted while Redis is unreachable are kept in the process and added
on the next contact.
``trimmed`` counts acknowledged entries removed from the stream; it is not an outcome, and
neither is ``appended:<stream>``.

Trimming never removes a frame that still needs a worker: the enqueue script trims
with ``XTRIM MINID`` to at most ``maxlen`` entries, bounded by the oldest pending entry and
the first undelivered one, so only acknowledged entries go (``XADD MAXLEN ~`` would also
drop frames a worker holds, and their results would be discarded).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import cv2
import redis

from pipelines import metrics
from pipelines.backoff import Backoff
from pipelines.clips import Clip, decode
from pipelines.config import QueueConfig
from pipelines.detect import Detection
from pipelines.ingest import Frame
from pipelines.logs import kv
from pipelines.redis_urls import make_client
from pipelines.worker import log_redis_down

log = logging.getLogger(__name__)

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


IDENTITY = "enqueued == described + expired + dead + pending"

ENQUEUE_LUA = """
-- KEYS: frames stream, image key, stats hash, dedupe key, producer record[, clip key]
-- ARGV: jpeg, image ttl s, maxlen, group, dedupe ttl s, run id, frames still buffered,
--       clip blob ('' without a clip key), then field/value pairs of the entry
-- returns {entry id ('' when refused), entries trimmed, 1 if the frame was already enqueued}
local stream, stats, maxlen, group = KEYS[1], KEYS[3], tonumber(ARGV[3]), ARGV[4]
if redis.call('HGET', KEYS[5], 'run') == ARGV[6] then
  redis.call('HSET', KEYS[5], 'buffered', ARGV[7])
end
local existing = redis.call('GET', KEYS[4])
if existing then  -- a retried send whose first try got through
  redis.call('HINCRBY', stats, 'enqueue_duplicate', 1)
  return {existing, 0, 1}
end
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
  redis.call('HINCRBY', stats, 'refused_queue_full', 1)
  return {'', 0, 0}
end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
if KEYS[6] then redis.call('SET', KEYS[6], ARGV[8], 'EX', ARGV[2]) end
local fields = {}
for i = 9, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', stream, '*', unpack(fields))
redis.call('SET', KEYS[4], id, 'EX', ARGV[5])
redis.call('HINCRBY', stats, 'enqueued', 1)
-- trim to maxlen, oldest first, but only acknowledged entries: stop at the oldest pending
-- one and at the first one not yet delivered
local function older(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, bm = tonumber(am), tonumber(bm)
  if am ~= bm then return am < bm end
  return tonumber(as) < tonumber(bs)
end
local trimmed = 0
local excess = redis.call('XLEN', stream) - maxlen
if excess > 0 then
  local head = redis.call('XRANGE', stream, '-', '+', 'COUNT', excess + 1)
  local keep = head[#head][1]
  local pel = redis.call('XPENDING', stream, group)
  if pel[1] > 0 and older(pel[2], keep) then keep = pel[2] end
  local unseen = redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', 1)
  if unseen[1] and older(unseen[1][1], keep) then keep = unseen[1][1] end
  trimmed = redis.call('XTRIM', stream, 'MINID', keep)
  if trimmed > 0 then redis.call('HINCRBY', stats, 'trimmed', trimmed) end
end
return {id, trimmed, 0}
"""

COMMIT_LUA = """
-- KEYS: frames stream, output stream, latest hash, stats hash[, keys to delete: the image,
--       a clip]
-- ARGV: group, entry id, outcome (described|dead|expired), stats field, output maxlen,
--       then field/value pairs of the output entry
-- each appended output entry carries n: its number in that stream (appended:<stream>)
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  redis.call('HINCRBY', KEYS[4], 'duplicate_discarded', 1)
  return 0
end
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
if ARGV[3] == 'described' or ARGV[3] == 'dead' then
  local n = redis.call('HINCRBY', KEYS[4], 'appended:' .. KEYS[2], 1)
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'n', n, unpack(fields))
end
if ARGV[3] == 'described' then
  redis.call('HSET', KEYS[3], unpack(fields))
end
redis.call('HINCRBY', KEYS[4], ARGV[4], 1)
for i = 5, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""

PRODUCER_LUA = """
-- KEYS: producer record, stats hash
-- ARGV: mode (start|beat|stop), run id, frames buffered, now, record ttl s, batch number,
--       then counter/increment pairs for the stats hash
-- returns frames added to lost:crash (start), -1 when another run holds the record, else 0
local rec, stats, mode, run = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local owner = redis.call('HGET', rec, 'run')
local lost = 0
if mode == 'start' and owner and owner ~= run then  -- a previous run that did not stop
  lost = tonumber(redis.call('HGET', rec, 'buffered') or '0') or 0
  if lost > 0 then redis.call('HINCRBY', stats, 'lost:crash', lost) end
  redis.call('DEL', rec)
  owner = false
end
if owner and owner ~= run then  -- another pipeline runs under this name: count, keep out
  for i = 7, #ARGV, 2 do redis.call('HINCRBY', stats, ARGV[i], ARGV[i + 1]) end
  return -1
end
local batch = tonumber(ARGV[6])
if batch > tonumber(redis.call('HGET', rec, 'flushed') or '0') then  -- not added by a retry
  for i = 7, #ARGV, 2 do redis.call('HINCRBY', stats, ARGV[i], ARGV[i + 1]) end
end
if mode == 'stop' then
  redis.call('DEL', rec)
else
  redis.call('HSET', rec, 'run', run, 'buffered', ARGV[3], 'heartbeat', ARGV[4],
             'flushed', batch)
  redis.call('EXPIRE', rec, ARGV[5])
end
return lost
"""

ACCOUNTING_LUA = """
-- KEYS: stats hash, frames stream; ARGV: group
-- one snapshot of the counters and of the frames still queued (pending list, undelivered)
local in_pel, undelivered = 0, 0
if redis.call('EXISTS', KEYS[2]) == 1 then
  undelivered = redis.call('XLEN', KEYS[2])  -- no group yet: nothing was delivered
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[2])) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == ARGV[1] then
      in_pel = info['pending']
      undelivered = #redis.call('XRANGE', KEYS[2], '(' .. info['last-delivered-id'], '+')
    end
  end
end
return {redis.call('HGETALL', KEYS[1]), in_pel, undelivered}
"""


# the ``camera:<id>`` hash: per camera from ``FrameQueue(live=...)``, then the sender's own
CAMERA_FIELDS = (
    "connected", "decoded_fps", "decoded", "sampled", "detected", "gated", "enqueued",
    "dropped", "reconnects", "last_frame_ts", "persons", "last_error",
    "instance", "run", "updated", "ttl_s", "stopped",
)  # fmt: skip


def connect(url: str, block_ms: int = 0) -> redis.Redis:
    """A client whose reads outlive an ``XREADGROUP BLOCK`` but not a dead server.

    Any URL ``config.redis_url`` accepts: ``redis://``, ``rediss://``, ``unix://``,
    ``redis+sentinel://`` (the current master) and ``redis+cluster://`` (``redis_urls``)."""
    return make_client(
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


def accounting(client: redis.Redis, cfg: QueueConfig) -> dict[str, Any]:
    """The stats counters in one snapshot with the queue, and whether ``IDENTITY`` holds.

    ``expired`` / ``dead`` are summed over their reasons (``*_by_reason`` has the parts);
    ``pending`` is ``in_pel + undelivered``; ``unaccounted`` is what the identity misses
    (0 when it holds). ``not_enqueued`` lists the counters of frames that never reached the
    stream, ``producers`` each pipeline's record (frames it holds unsent, heartbeat age).
    """
    script = client.register_script(ACCOUNTING_LUA)
    raw, in_pel, undelivered = script(keys=[cfg.stats_key, cfg.frames_stream], args=[cfg.group])
    counters = {_s(k): int(v) for k, v in zip(raw[::2], raw[1::2], strict=True)}
    expired = {k.partition(":")[2]: v for k, v in counters.items() if k.startswith("expired:")}
    dead = {k.partition(":")[2]: v for k, v in counters.items() if k.startswith("dead:")}
    pending = int(in_pel) + int(undelivered)
    outcomes = counters.get("described", 0) + sum(expired.values()) + sum(dead.values())
    enqueued = counters.get("enqueued", 0)
    return {
        "identity": IDENTITY,
        "holds": enqueued == outcomes + pending,
        "unaccounted": enqueued - outcomes - pending,
        "enqueued": enqueued,
        "described": counters.get("described", 0),
        "expired": sum(expired.values()),
        "dead": sum(dead.values()),
        "pending": pending,
        "in_pel": int(in_pel),
        "undelivered": int(undelivered),
        "expired_by_reason": expired,
        "dead_by_reason": dead,
        "not_enqueued": {
            k: v
            for k, v in counters.items()
            if k == "refused_queue_full" or k.startswith(("dropped:", "lost:"))
        },
        "counters": counters,
        "producers": producer_records(client, cfg),
    }


def producer_records(client: redis.Redis, cfg: QueueConfig) -> dict[str, dict[str, Any]]:
    """Each pipeline's record by instance name: run id, frames buffered, heartbeat age."""
    out: dict[str, dict[str, Any]] = {}
    for key in client.scan_iter(match=f"{cfg.producer_prefix}*", count=100):
        raw = {_s(k): _s(v) for k, v in client.hgetall(key).items()}
        if not raw:
            continue
        beat = float(raw.get("heartbeat") or 0.0)
        out[_s(key)[len(cfg.producer_prefix) :]] = {
            "run": raw.get("run", ""),
            "buffered": int(raw.get("buffered") or 0),
            "heartbeat_age_s": round(max(0.0, time.time() - beat), 3) if beat else None,
        }
    return out


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class Outgoing:
    """A gated frame on its way to Redis."""

    frame: Frame
    detections: list[Detection]
    gate_reason: str
    tracks: tuple[int, ...] = ()  # per-track gating: the tracks this description is for
    crop: tuple[int, int, int, int] | None = None  # x1, y1, x2, y2: the part of the frame sent
    suffix: str = ""  # a second send of one frame (track_end) gets its own frame_uid
    clip: Clip | None = None  # describer.view clip: the frames to send (``frame`` is the last)


class ClipTooLarge(ValueError):
    """A clip's JPEGs exceed ``max_clip_bytes``: not enqueued, counted ``clip_too_large``."""


def encode_entry(item: Outgoing, cfg: QueueConfig) -> tuple[bytes, dict[str, str]]:
    """JPEG bytes (cropped to ``crop``, downscaled to ``max_image_side``) and the stream
    entry's fields.

    Boxes are shifted and scaled with the image, so they match the JPEG the describer sends;
    with a crop, boxes wholly outside it are left out and the others clipped to it. The
    fields added for tracking and crops (``tracks``, ``crop``, ``frame_width``,
    ``frame_height``) appear only when set: other entries keep their old shape.
    """
    image = item.frame.image
    detections = item.detections
    ox = oy = 0
    if item.crop is not None:
        full_h, full_w = image.shape[:2]
        x1, y1, x2, y2 = item.crop
        x1, y1 = max(0, min(x1, full_w - 1)), max(0, min(y1, full_h - 1))
        x2, y2 = max(x1 + 1, min(x2, full_w)), max(y1 + 1, min(y2, full_h))
        image, ox, oy = image[y1:y2, x1:x2], x1, y1
        detections = [
            replace(d, box=(max(bx1, x1), max(by1, y1), min(bx2, x2), min(by2, y2)))
            for d in detections
            for bx1, by1, bx2, by2 in [d.box]
            if bx1 < x2 and bx2 > x1 and by1 < y2 and by2 > y1
        ]
    height, width = image.shape[:2]
    scale = min(1.0, cfg.max_image_side / max(height, width))
    if scale < 1.0:
        width, height = round(width * scale), round(height * scale)
        image = cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)
    ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, cfg.jpeg_quality])
    if not ok:
        raise ValueError("JPEG encoding failed")
    boxes = []
    for det in detections:
        d = det.to_dict()
        x1, y1, x2, y2 = det.box
        d["box"] = [round(v * scale, 1) for v in (x1 - ox, y1 - oy, x2 - ox, y2 - oy)]
        boxes.append(d)
    fields = _entry_fields(item, item.frame.ts, item.frame.seq, boxes, width, height)
    if item.crop is not None:
        full_h, full_w = item.frame.image.shape[:2]
        fields["crop"] = json.dumps([ox, oy, ox + image.shape[1], oy + image.shape[0]])
        fields["frame_width"], fields["frame_height"] = str(full_w), str(full_h)
    return buf.tobytes(), fields


def _entry_fields(
    item: Outgoing, ts: float, seq: int, boxes: list, width: int, height: int
) -> dict[str, str]:
    """The fields every frame entry carries, a single frame's or a clip's (its last frame)."""
    fields = {
        "camera": item.frame.camera_id,
        "ts": f"{ts:.6f}",
        "seq": str(seq),
        "persons": str(len(item.detections)),
        "boxes": json.dumps(boxes, separators=(",", ":")),
        "width": str(width),
        "height": str(height),
        "gate": item.gate_reason,
    }
    if item.tracks:
        fields["tracks"] = json.dumps(list(item.tracks))
    return fields


def encode_clip(item: Outgoing, cfg: QueueConfig) -> tuple[bytes, dict[str, str], bytes]:
    """A clip's snapshot JPEG (its last frame), the stream entry's fields and the clip blob
    (every frame's JPEG back to back, oldest first), all cropped to ``clip.crop``.

    The fields are a single frame's (``camera``, ``ts``, ``boxes`` ... of the last frame, in
    the sent frames' coordinates) plus ``clip_sizes`` (each JPEG's length), ``clip_ts``
    (seconds from the first frame), ``clip_seconds`` and, for per-track gating,
    ``clip_tracks``: per triggering track its box in the first and last frame it is seen
    in, and in how many. Raises ``ClipTooLarge`` past ``max_clip_bytes``.
    """
    clip = item.clip
    assert clip is not None and clip.frames
    last = clip.frames[-1]
    full_w, full_h = last.size
    scale = last.scale
    jw, jh = max(1, round(full_w * scale)), max(1, round(full_h * scale))
    region = (0, 0, full_w, full_h)
    jpegs = [f.jpeg for f in clip.frames]
    width, height = jw, jh
    if clip.crop is not None:
        x1, y1, x2, y2 = clip.crop
        x1, y1 = max(0, min(x1, full_w - 1)), max(0, min(y1, full_h - 1))
        x2, y2 = max(x1 + 1, min(x2, full_w)), max(y1 + 1, min(y2, full_h))
        region = (x1, y1, x2, y2)
        cx1, cy1 = math.floor(x1 * scale), math.floor(y1 * scale)
        cx2, cy2 = max(cx1 + 1, math.ceil(x2 * scale)), max(cy1 + 1, math.ceil(y2 * scale))
        jpegs = []
        for frame in clip.frames:
            part = decode(frame)[cy1:cy2, cx1:cx2]
            ok, buf = cv2.imencode(".jpg", part, [cv2.IMWRITE_JPEG_QUALITY, cfg.jpeg_quality])
            if not ok:
                raise ValueError("JPEG encoding failed")
            jpegs.append(buf.tobytes())
        width, height = cx2 - cx1, cy2 - cy1
    blob = b"".join(jpegs)
    if len(blob) > cfg.max_clip_bytes:
        raise ClipTooLarge(
            f"clip of {len(jpegs)} frames is {len(blob)} bytes, over queue.max_clip_bytes "
            f"{cfg.max_clip_bytes}: lower clip_frames, max_image_side or jpeg_quality"
        )
    boxes = _boxes_in(item.detections, region, scale)
    fields = _entry_fields(item, last.ts, last.seq, boxes, width, height)
    if clip.crop is not None:
        fields["crop"] = json.dumps(list(region))
        fields["frame_width"], fields["frame_height"] = str(full_w), str(full_h)
    first_ts = clip.frames[0].ts
    fields["clip_sizes"] = ",".join(str(len(j)) for j in jpegs)
    fields["clip_ts"] = json.dumps([round(f.ts - first_ts, 3) for f in clip.frames])
    fields["clip_seconds"] = f"{clip.seconds:.3f}"
    if item.tracks:
        fields["clip_tracks"] = json.dumps(
            _track_paths(clip, item.tracks, region, scale), separators=(",", ":")
        )
    return jpegs[-1], fields, blob


def _boxes_in(
    detections: Any, region: tuple[int, int, int, int], scale: float
) -> list[dict[str, Any]]:
    """Detections as entry boxes in a sent image showing ``region`` of the frame at
    ``scale``: those wholly outside left out, the others clipped to it."""
    x1, y1, x2, y2 = region
    out = []
    for det in detections:
        bx1, by1, bx2, by2 = det.box
        if not (bx1 < x2 and bx2 > x1 and by1 < y2 and by2 > y1):
            continue
        d = det.to_dict()
        clipped = (max(bx1, x1) - x1, max(by1, y1) - y1, min(bx2, x2) - x1, min(by2, y2) - y1)
        d["box"] = [round(v * scale, 1) for v in clipped]
        out.append(d)
    return out


def _track_paths(
    clip: Clip, tracks: tuple[int, ...], region: tuple[int, int, int, int], scale: float
) -> dict[str, dict[str, Any]]:
    """Per track: label, box in the first and last clip frame it is in, frames seen."""
    out: dict[str, dict[str, Any]] = {}
    for frame in clip.frames:
        for box in _boxes_in([d for d in frame.detections if d.track_id in tracks], region, scale):
            path = out.setdefault(str(box["track_id"]), {"label": box["label"], "frames": 0})
            path.setdefault("first", box["box"])
            path["last"] = box["box"]
            path["frames"] += 1
    return out


class FrameQueue:
    """Producer: a bounded local buffer drained into Redis by one thread.

    Why a buffer and a thread: the detector loop must never wait on Redis. While Redis is
    unreachable the newest ``local_buffer`` frames wait here (older ones are dropped,
    counted ``buffer_full``), frames older than ``max_frame_age_s`` are dropped as
    ``expired``, and the thread reconnects with backoff. Drops are counted in Redis too
    (``dropped:<reason>``, added on the next contact), and every ``heartbeat_s`` the thread
    records how many frames it holds in ``producer:<instance>``, so a SIGKILL leaves a trace
    that the next run under the same instance name counts (``lost:crash``). On the same beat
    it writes each camera's ``camera:<id>`` hash from ``live()`` (the detector loop never
    waits on Redis for it).
    """

    def __init__(
        self,
        redis_url: str,
        cfg: QueueConfig,
        on_drop: Callable[[str, str], None],
        client: redis.Redis | None = None,
        live: Callable[[], dict[str, dict[str, str]]] | None = None,
    ) -> None:
        self.cfg = cfg
        self._live = live  # camera id -> its live numbers (CAMERA_FIELDS), as strings
        self._live_ttl_ms = max(1, round(3 * cfg.heartbeat_s * 1000))
        self._live_failed = False
        self.enqueued_by_camera: Counter[str] = Counter()
        self.client = client or connect(redis_url)
        self._enqueue = self.client.register_script(ENQUEUE_LUA)
        self._producer = self.client.register_script(PRODUCER_LUA)
        self._on_drop = on_drop  # (camera_id, reason)
        self.run_id = uuid.uuid4().hex[:12]
        self.instance = cfg.instance or socket.gethostname()
        self.record_key = f"{cfg.producer_prefix}{self.instance}"
        self._dedupe_ttl = max(cfg.image_ttl_s, math.ceil(cfg.max_frame_age_s))
        self._buffer: deque[Outgoing] = deque()
        self._sending = 0  # taken from the buffer, send not finished (0 or 1)
        self._cond = threading.Condition()
        self._closing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="enqueue", daemon=True)
        # drop counters not yet in Redis, and the batch being added (retried as is)
        self._counts_lock = threading.Lock()
        self._unreported: Counter[str] = Counter()
        self._batch: dict[str, int] = {}
        self._batch_no = 0
        self._started = False  # the record is ours (a predecessor's is counted)
        self._next_beat = 0.0
        self._shared_warned = False
        self.enqueued = 0
        self.duplicates = 0
        self.trimmed = 0
        self.redis_errors = 0
        self.lost_crash = 0
        self.connected = False  # the last Redis call got through
        self._backoff = Backoff(0.2, 5.0)

    def start(self) -> None:
        self._thread.start()

    def frame_uid(self, frame: Frame) -> str:
        """The frame's identity: survives a retried send, not a pipeline restart."""
        return f"{frame.camera_id}:{self.run_id}:{frame.seq}"

    def item_uid(self, item: Outgoing) -> str:
        """The sent item's identity: the frame's, plus its ``suffix`` when it has one."""
        uid = self.frame_uid(item.frame)
        return f"{uid}:{item.suffix}" if item.suffix else uid

    def submit(self, item: Outgoing) -> None:
        """Queue a frame for Redis without blocking; the oldest is dropped when full."""
        with self._cond:
            if self._closing:
                self._drop(item.frame.camera_id, "shutdown_unsent")
                return
            if len(self._buffer) >= self.cfg.local_buffer:
                oldest = self._buffer.popleft()
                self._drop(oldest.frame.camera_id, "buffer_full")
            self._buffer.append(item)
            metrics.ENQUEUE_BUFFER.set(len(self._buffer))
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._buffer)

    def stop(self, flush_timeout: float = 5.0) -> None:
        """Stop accepting; send what is buffered for up to ``flush_timeout``; count the rest.

        Then the drop counters go to Redis and the producer record is removed: a clean stop
        leaves nothing for the next run to count as lost.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + flush_timeout
        while self.pending() and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join(5.0)
        with self._cond:
            while self._buffer:
                self._drop(self._buffer.popleft().frame.camera_id, "shutdown_unsent")
            metrics.ENQUEUE_BUFFER.set(0)
        if self._thread.is_alive() or not self.connected:
            # Redis is unreachable (or the thread still waits on it): rather than delay the
            # stop, leave the record -- the next run counts its buffered frames as lost
            log.warning(kv("producer_unreported", instance=self.instance, run=self.run_id))
            return
        try:
            if not self._started:
                self._report("start")
            self._report("stop")
            self._publish_live(stopped=True)
        except redis.RedisError as exc:  # the record stays: the next run counts the buffer
            log.warning(kv("producer_unreported", instance=self.instance, error=exc))

    # -- counting ----------------------------------------------------------------------
    def _drop(self, camera: str, reason: str) -> None:
        self._on_drop(camera, reason)
        if reason == "queue_full":  # the enqueue script counted it (refused_queue_full)
            return
        with self._counts_lock:
            self._unreported[f"dropped:{reason}"] += 1

    def _report(self, mode: str) -> None:
        """Add the drop counters to Redis and write the producer record, in one script.

        Retry-safe: a batch keeps its number until Redis confirms it, and the script adds a
        batch only once.
        """
        with self._counts_lock:
            if not self._batch and self._unreported:
                self._batch_no += 1
                self._batch = dict(self._unreported)
                self._unreported.clear()
            batch, number = dict(self._batch), self._batch_no
        with self._cond:
            buffered = len(self._buffer) + self._sending
        args: list[Any] = [mode, self.run_id, buffered, f"{time.time():.3f}"]
        args += [self.cfg.producer_ttl_s, number]
        for field, n in batch.items():
            args += [field, n]
        lost = int(self._producer(keys=[self.record_key, self.cfg.stats_key], args=args))
        self._reached_redis()
        with self._counts_lock:
            self._batch = {}
        if mode == "start":
            self._started = True
            if lost > 0:
                self.lost_crash = lost
                metrics.FRAMES_LOST_CRASH.inc(lost)
                log.warning(kv("previous_run_lost", instance=self.instance, frames=lost))
        if lost < 0 and not self._shared_warned:
            self._shared_warned = True
            log.warning(kv("instance_in_use", instance=self.instance, run=self.run_id))

    def _keep_record(self) -> None:
        """Claim the record on first contact, then refresh it every ``heartbeat_s``.

        Raises REDIS_DOWN; a refusal (e.g. OOM) is logged and frames still go out.
        """
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + self.cfg.heartbeat_s
        try:
            self._report("beat" if self._started else "start")
            self._publish_live()
        except REDIS_DOWN:
            raise
        except redis.RedisError as exc:
            log.warning(kv("producer_record_refused", instance=self.instance, error=exc))

    def _publish_live(self, stopped: bool = False) -> None:
        """Write each camera's ``camera:<id>`` hash (one round trip), TTL three heartbeats."""
        if self._live is None:
            return
        try:
            cameras = self._live()
        except Exception as exc:  # a bug in the numbers must not stop the frames
            if not self._live_failed:
                log.exception(kv("camera_live_failed", error=repr(exc)))
            self._live_failed = True
            return
        own = {
            "instance": self.instance,
            "run": self.run_id,
            "updated": f"{time.time():.3f}",
            "ttl_s": f"{self._live_ttl_ms / 1000:g}",
            "stopped": "1" if stopped else "0",
        }
        pipe = self.client.pipeline(transaction=False)
        for camera, numbers in cameras.items():
            key = f"{self.cfg.camera_prefix}{camera}"
            pipe.hset(key, mapping={**numbers, **own})
            pipe.pexpire(key, self._live_ttl_ms)
        pipe.execute()

    # -- the thread --------------------------------------------------------------------
    def _next(self) -> Outgoing | None:
        """The oldest buffered frame, or None after a short wait (time for a heartbeat)."""
        with self._cond:
            if not self._buffer and not self._stop.is_set() and not self._closing:
                self._cond.wait(min(0.5, max(0.01, self._next_beat - time.monotonic())))
            if self._stop.is_set() or not self._buffer:
                return None
            item = self._buffer.popleft()
            self._sending = 1
            metrics.ENQUEUE_BUFFER.set(len(self._buffer))
            return item

    def _requeue(self, item: Outgoing) -> None:
        with self._cond:
            self._sending = 0
            if len(self._buffer) >= self.cfg.local_buffer:
                self._drop(item.frame.camera_id, "buffer_full")
            else:
                self._buffer.appendleft(item)
            metrics.ENQUEUE_BUFFER.set(len(self._buffer))

    def _reached_redis(self) -> None:
        self._backoff.reset()
        if not self.connected:
            log.info(kv("redis_connected", component="enqueue"))
        self.connected = True

    def _run(self) -> None:
        while True:
            item: Outgoing | None = None
            try:
                self._keep_record()
                item = self._next()
                if item is None:
                    if self._stop.is_set() or (self._closing and not self.pending()):
                        return
                    continue
                self._handle(item)
            except REDIS_DOWN as exc:
                self.redis_errors += 1
                metrics.REDIS_ERRORS.labels("enqueue").inc()
                if self.connected or self._backoff.attempts == 0:
                    log_redis_down("enqueue", exc)
                self.connected = False
                self._next_beat = 0.0  # on the next contact: counters and record first
                if item is not None:
                    self._requeue(item)
                if self._backoff.wait(self._stop):
                    return

    def _handle(self, item: Outgoing) -> None:
        """Send one frame; a frame Redis cannot take is dropped, counted. Raises REDIS_DOWN."""
        camera = item.frame.camera_id
        try:
            if time.time() - item.frame.ts > self.cfg.max_frame_age_s:
                self._drop(camera, "expired")
                return
            self._send(item)
        except REDIS_DOWN:
            raise
        except redis.RedisError as exc:  # e.g. OOM: Redis refuses writes
            log.warning(kv("frame_refused", camera=camera, error=exc))
            self._drop(camera, "redis_refused")
        except ClipTooLarge as exc:
            log.warning(kv("clip_too_large", camera=camera, error=exc))
            self._drop(camera, "clip_too_large")
        except ValueError as exc:
            log.warning(kv("frame_unencodable", camera=camera, error=exc))
            self._drop(camera, "encode_failed")
        with self._cond:
            self._sending = 0

    def _send(self, item: Outgoing) -> None:
        blob = b""
        if item.clip is not None:
            jpeg, fields, blob = encode_clip(item, self.cfg)
        else:
            jpeg, fields = encode_entry(item, self.cfg)
        uid = self.item_uid(item)
        fields["frame_uid"] = uid
        image_key = f"{self.cfg.image_prefix}{uid}"
        fields["image"] = image_key
        clip_key = f"{image_key}:clip"  # the image key's prefix: same cluster slot
        if blob:
            fields["clip"] = clip_key
        args: list[Any] = [jpeg, self.cfg.image_ttl_s, self.cfg.maxlen, self.cfg.group]
        args += [self._dedupe_ttl, self.run_id, self.pending(), blob]
        for key, value in fields.items():
            args += [key, value]
        keys = [
            self.cfg.frames_stream,
            image_key,
            self.cfg.stats_key,
            f"{self.cfg.dedupe_prefix}{uid}",
            self.record_key,
            *([clip_key] if blob else []),
        ]
        entry_id, trimmed, duplicate = self._enqueue(keys=keys, args=args)
        self._reached_redis()
        camera = item.frame.camera_id
        if not entry_id:
            self._drop(camera, "queue_full")
            return
        self.enqueued += 1
        self.enqueued_by_camera[camera] += 1
        metrics.FRAMES_ENQUEUED.labels(camera).inc()
        if duplicate:  # the reply to an earlier try was lost: that try enqueued it
            self.duplicates += 1
            metrics.ENQUEUE_DUPLICATES.inc()
            log.info(kv("frame_already_enqueued", camera=camera, uid=uid, id=_s(entry_id)))
            return
        if trimmed:
            self.trimmed += int(trimmed)
            metrics.QUEUE_TRIMMED.inc(int(trimmed))
        log.debug(
            kv("frame_enqueued", camera=camera, id=_s(entry_id), persons=len(item.detections))
        )
