"""Structured events: a camera's ``describer.response_schema`` goes to our real server as
``response_format: json_schema`` (strict); the answer -- random weights, so only the server's
constrained decoding can make it valid -- is stored as the event's fields and published."""

from __future__ import annotations

import json

import pytest
from pipeline_helpers import DescriberThread, descriptions, enqueue_frames, wait_until

from pipelines.events.store import EventStore, NewEvent
from pipelines.notify.event import build_event

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"enum": [0, 1, 2, 3]},
        "activity": {"enum": ["walking", "standing", "running", "none"]},
        "threat": {"enum": ["none", "low", "high"]},
    },
    "required": ["people", "activity", "threat"],
    "additionalProperties": False,
}


def test_structured_fields_are_schema_valid_stored_and_published(
    redis_server, vlm_server, make_config, tmp_path
):
    config = make_config(
        redis_server.url,
        cameras=[
            {"id": "door", "url": "unused.mp4", "describer": {"response_schema": SCHEMA}},
            {"id": "yard", "url": "unused.mp4"},
        ],
        describer={"base_url": vlm_server, "max_tokens": 64, "temperature": 1.0},
    )
    enqueue_frames(redis_server.url, config.queue, 3, camera="door")
    enqueue_frames(redis_server.url, config.queue, 1, camera="yard")
    worker = DescriberThread(config, "structured").start()
    client = redis_server.client()
    try:
        wait_until(lambda: len(descriptions(client, config.queue)) == 4, 120, what="4 described")
    finally:
        worker.stop()
    got = descriptions(client, config.queue)
    door = [d for d in got if d["camera"] == "door"]
    yard = [d for d in got if d["camera"] == "yard"]
    assert len(door) == 3 and len(yard) == 1
    assert "structured" not in yard[0]  # a camera without a schema: text only
    store = EventStore(tmp_path / "events")
    for entry in door:
        fields = json.loads(entry["structured"])
        assert set(fields) == set(SCHEMA["required"])  # no additional properties
        for name, value in fields.items():
            assert value in SCHEMA["properties"][name]["enum"]
        assert json.loads(entry["text"]) == fields
        event = NewEvent.from_entry(entry["frame_id"], entry)
        store.add([event])
        stored = store.get(event.id)["structured"]
        assert (json.loads(stored) if isinstance(stored, str) else stored) == fields
        published = json.loads(build_event(entry["frame_id"], entry).body)
        assert published["structured"] == fields
