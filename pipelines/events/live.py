"""Per-camera live numbers for ``GET /api/cameras``: what the pipeline and the queue say now.

The pipeline writes each camera's ``camera:<id>`` hash every heartbeat with a TTL of three
(``pipelines/queue.py``), so a missing hash means no running pipeline reads the camera: it is
``offline``, never shown with the numbers it had when it stopped. From the queue come the
frames of the camera that no describer has taken yet and, from ``latest:<camera>``, the
describer lag: capture to description of its latest description.

Everything here reads Redis; the caller turns a Redis failure into an ``error`` field.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import redis

from pipelines.config import QueueConfig
from pipelines.queue import CAMERA_FIELDS

_INTS = ("decoded", "sampled", "detected", "gated", "enqueued", "reconnects", "persons")
_FLOATS = ("decoded_fps", "last_frame_ts", "updated", "ttl_s")


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _number(value: str | None, kind: type) -> Any:
    try:
        return kind(value) if value not in (None, "") else None
    except ValueError:
        return None


def parse_record(raw: dict[str, str], now: float) -> dict[str, Any]:
    """A ``camera:<id>`` hash as the API returns it, with its ``state``:

    ``offline`` (the pipeline stopped), ``stale`` (older than its TTL: a clock apart or a
    pipeline stuck), ``disconnected`` (the stream is down, the pipeline retries) or ``online``.
    """
    out: dict[str, Any] = {k: _number(raw.get(k), int) for k in _INTS}
    out |= {k: _number(raw.get(k), float) for k in _FLOATS}
    try:
        dropped = json.loads(raw.get("dropped") or "{}")
    except json.JSONDecodeError:
        dropped = {}
    if not isinstance(dropped, dict):
        dropped = {}
    out["dropped"] = {str(k): v for k, v in dropped.items() if isinstance(v, int)}
    out["dropped_total"] = sum(out["dropped"].values())
    out["connected"] = raw.get("connected") == "1"
    out["instance"] = raw.get("instance")
    out["last_error"] = raw.get("last_error") or None
    updated, ttl = out["updated"], out["ttl_s"] or 3.0
    out["age_s"] = round(max(0.0, now - updated), 3) if updated else None
    if raw.get("stopped") == "1":
        out["state"] = "offline"
    elif out["age_s"] is None or out["age_s"] > ttl:
        out["state"] = "stale"
    else:
        out["state"] = "online" if out["connected"] else "disconnected"
    return out


def camera_records(client: redis.Redis, q: QueueConfig, ids: list[str]) -> dict[str, Any]:
    """Each camera's live record, or None when its hash is gone (no pipeline reads it)."""
    pipe = client.pipeline(transaction=False)
    for cam in ids:
        pipe.hmget(f"{q.camera_prefix}{cam}", list(CAMERA_FIELDS))
    now = time.time()
    out: dict[str, Any] = {}
    for cam, values in zip(ids, pipe.execute(), strict=True):
        raw = {k: _s(v) for k, v in zip(CAMERA_FIELDS, values, strict=True) if v is not None}
        out[cam] = parse_record(raw, now) if raw else None
    return out


def queued_per_camera(client: redis.Redis, q: QueueConfig) -> Counter[str]:
    """Frames in the stream not yet delivered to a describer, by camera (at most ``maxlen``:
    the producer refuses more)."""
    try:
        groups = client.xinfo_groups(q.frames_stream)
    except redis.ResponseError:  # no stream yet
        return Counter()
    last = next((_s(g["last-delivered-id"]) for g in groups if _s(g["name"]) == q.group), "0-0")
    entries = client.xrange(q.frames_stream, min=f"({last}", max="+", count=q.maxlen)
    return Counter(_s(fields.get(b"camera", b"?")) for _id, fields in entries)


def describer_lag(latest: dict[str, str | None] | None) -> float | None:
    """Capture -> description time of a camera's latest description (``latest:<camera>``)."""
    if not latest:
        return None
    ts = _number(latest.get("ts"), float)
    described = _number(latest.get("described_at"), float)
    if ts is None or described is None:
        return None
    return round(max(0.0, described - ts), 3)
