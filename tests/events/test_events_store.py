"""The event store on its own: idempotent insert, the search index following every change,
snapshot paths that stay in their folder, entries too odd to parse still stored."""

from __future__ import annotations

import time

import cv2
import pytest

from pipelines.events.store import EventStore, NewEvent, QueryError, safe_name
from tests.events.events_helpers import scene


@pytest.fixture
def store(tmp_path):
    s = EventStore(tmp_path / "events")
    yield s
    s.close()


def event(i: int, text: str = "a person", camera: str = "door") -> NewEvent:
    return NewEvent(id=f"{camera}:run:{i}", camera=camera, ts=time.time() - i, text=text)


def test_an_id_is_stored_once(store):
    assert len(store.add([event(1), event(2)])) == 2
    assert store.add([event(1, "again")]) == []
    assert store.count_events() == 2
    assert store.get("door:run:1")["text"] == "a person"
    assert store.counters() == {"duplicate": 1, "stored": 2}


def test_the_index_follows_inserts_new_descriptions_and_deletes(store):
    store.add([event(1, "a dog on the lawn"), event(2, "a cat on the wall")])
    assert [e["id"] for e in store.list_events(q="dog")[0]] == ["door:run:1"]
    store.replace_description("door:run:1", "a fox on the lawn", "tiny", time.time())
    assert store.list_events(q="dog")[0] == []
    assert [e["id"] for e in store.list_events(q="fox")[0]] == ["door:run:1"]
    assert [h["text"] for h in store.history(store.get("door:run:1")["seq"])] == [
        "a dog on the lawn"
    ]
    store.delete(store.older_than("door", time.time()), "age")
    assert store.list_events(q="fox OR cat")[0] == []
    assert store.counters()["deleted:age"] == 2


def test_a_malformed_query_is_a_query_error(store):
    store.add([event(1)])
    with pytest.raises(QueryError):
        store.list_events(q='"open')


@pytest.mark.parametrize("name", ["../../etc", "..", "a/b", "x\\y", "", "cam:run:1", "é"])
def test_path_components_cannot_climb_out(name):
    safe = safe_name(name)
    assert "/" not in safe and "\\" not in safe and not safe.startswith(".") and safe
    assert safe_name("front-door") == "front-door"  # valid camera ids stay readable


def test_snapshots_land_under_camera_and_day_even_for_hostile_names(store):
    ev = NewEvent.from_entry(
        "1-0",
        {"frame_uid": "../../x:1:1", "camera": "../../etc", "ts": "1700000000", "text": "t",
         "boxes": '[{"box": [1, 2, 30, 40], "label": "person", "conf": 0.5}]'},
    )  # fmt: skip
    _, jpeg = cv2.imencode(".jpg", scene())
    assert store.write_snapshots(ev, jpeg.tobytes())
    for rel in (ev.snapshot, ev.snapshot_boxes):
        path = (store.root / rel).resolve()
        assert path.is_relative_to(store.snapshot_root) and path.is_file()
        assert path.parent.name == "2023-11-14"
    store.add([ev])
    assert store.snapshot_file("../../x:1:1", boxes=True).name.endswith(".boxes.jpg")


def test_an_odd_entry_is_stored_with_what_can_be_read(store):
    ev = NewEvent.from_entry(
        "5-0",
        {"text": '{"people": 2}', "ts": "1e30", "persons": "many", "boxes": "{not json"},
    )
    store.add([ev])
    got = store.get("descriptions:5-0")
    assert got["persons"] == 0 and got["boxes"] == [] and got["structured"] == {"people": 2}
    assert abs(got["ts"] - time.time()) < 60
