"""One description as the event every sink sends: the same JSON body on MQTT and webhooks.

``event_id`` is the frame's ``frame_uid`` (``<camera>:<run>:<seq>``), the id the event store
uses too. Delivery is at least once, so a receiver may see an event twice -- always with the
same ``event_id``, which is what it de-duplicates on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

EVENT_TYPE = "description"  # Home Assistant's MQTT `event` entity needs an event_type key


@dataclass(frozen=True)
class Event:
    """A description ready to send: its id, camera and capture time, and the encoded body."""

    event_id: str
    camera: str
    ts: float
    body: bytes  # UTF-8 JSON, serialised once so every attempt sends the same bytes

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.body)


def skip_reason(fields: dict[str, str]) -> str | None:
    """Why a descriptions-stream entry is not an event (an outcome without a text), or None."""
    if "reason" in fields:
        return fields["reason"] or "no_text"
    if "text" not in fields or not fields.get("camera"):
        return "no_text"
    return None


def _number(value: str | None, kind: type = float) -> Any:
    try:
        return kind(float(value)) if value not in (None, "") else None
    except ValueError:
        return None


def _json(value: str | None, default: Any) -> Any:
    if value in (None, ""):
        return default
    try:
        return json.loads(value)
    except ValueError:
        return value


def build_event(entry_id: str, fields: dict[str, str]) -> Event:
    """The event for a described entry of the descriptions stream (``describe._finish``)."""
    camera = fields["camera"]
    event_id = fields.get("frame_uid") or f"{camera}:{entry_id}"
    payload: dict[str, Any] = {
        "event_id": event_id,
        "event_type": EVENT_TYPE,
        "camera": camera,
        "ts": _number(fields.get("ts")),
        "described_at": _number(fields.get("described_at")),
        "text": fields.get("text", ""),
        "persons": _number(fields.get("persons"), int) or 0,
        "boxes": _json(fields.get("boxes"), []),
        "model": fields.get("model", ""),
        "latency_s": _number(fields.get("latency_s")),
        "stream_id": entry_id,
    }
    if "structured" in fields:  # a describer asked for JSON output: pass it through parsed
        payload["structured"] = _json(fields["structured"], None)
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    return Event(event_id=event_id, camera=camera, ts=payload["ts"] or 0.0, body=body)
