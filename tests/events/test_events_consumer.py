"""Descriptions stream -> event store: one event per described frame, whatever crashes.

Real redis-server, real SQLite, the real consumer (inside the ui, on real uvicorn, or as a
``vision-serve ui`` process killed with SIGKILL); descriptions committed with the describers'
own Lua script.
"""

from __future__ import annotations

import signal
import threading
from collections import Counter
from pathlib import Path

import pytest
import redis

from pipelines.events.store import EventStore, NewEvent
from tests.events.events_helpers import UIProcess, describe, event_ids, get
from tests.pipelines.pipeline_helpers import wait_until

pytestmark = pytest.mark.timeout(60)


def group_pending(client: redis.Redis, config) -> int:
    return int(client.xpending(config.queue.descriptions_stream, config.events.group)["pending"])


def test_each_description_becomes_exactly_one_event(config, ui, redis_server):
    uids = describe(config, ["a person at the door", "two people talking", "a cyclist"])
    wait_until(lambda: ui.store.count_events() == 3, 10, what="3 events")
    assert sorted(event_ids(ui.url)) == sorted(uids)
    counters = ui.store.counters()
    assert counters["stored"] == 3 and "duplicate" not in counters
    assert group_pending(redis_server.client(), config) == 0
    event = get(ui.url, f"/api/events/{uids[0]}").json()
    assert event["text"] == "a person at the door"
    assert event["camera"] == "door" and event["persons"] == 1 and event["model"] == "tiny"
    assert event["boxes"][0]["box"] == [20.0, 16.0, 90.0, 110.0]
    assert event["has_snapshot"] and (event["width"], event["height"]) == (160, 120)
    assert event["history"] == []


def test_descriptions_written_before_the_ui_started_are_stored(config, start_ui):
    """The group is created from id 0: nothing described earlier is skipped."""
    uids = describe(config, ["early one", "early two"])
    ui = start_ui(config)
    wait_until(lambda: ui.store.count_events() == 2, 10, what="2 events")
    assert sorted(event_ids(ui.url)) == sorted(uids)


def test_redelivery_after_a_crash_between_commit_and_ack_adds_no_event(
    config, start_ui, redis_server
):
    """A ui killed after its SQLite commit but before XACK: its successor (same consumer
    name) reads the entries again from its pending list and stores only what is missing."""
    uids = describe(config, [f"event {i}" for i in range(6)])
    client = redis_server.client()
    q, e = config.queue, config.events
    client.xgroup_create(q.descriptions_stream, e.group, id="0")
    entries = client.xreadgroup(e.group, e.consumer, {q.descriptions_stream: ">"})[0][1]
    assert group_pending(client, config) == 6  # read by the "crashed" ui, never acked
    store = EventStore(e.data_dir)  # ... which had committed the first four
    store.add(
        [
            NewEvent.from_entry(i.decode(), {k.decode(): v.decode() for k, v in f.items()})
            for i, f in entries[:4]
        ]
    )
    store.close()

    ui = start_ui(config)
    wait_until(lambda: group_pending(client, config) == 0, 10, what="pending list drained")
    assert sorted(event_ids(ui.url)) == sorted(uids)
    counters = ui.store.counters()
    assert counters["stored"] == 6 and counters["duplicate"] == 4


def test_a_ui_killed_mid_stream_and_restarted_stores_each_description_once(
    config, redis_server, tmp_path: Path
):
    """SIGKILL while descriptions keep arriving; after the restart: one event per frame."""
    ui = UIProcess(config, tmp_path).start()
    uids: list[str] = []
    done = threading.Event()

    def writer() -> None:
        try:
            for i in range(8):
                uids.extend(describe(config, [f"burst {i} a", f"burst {i} b", f"burst {i} c"]))
        finally:
            done.set()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    wait_until(lambda: len(uids) >= 6, 20, what="first descriptions")
    ui.stop(signal.SIGKILL)
    wait_until(done.is_set, 30, what="writer done")
    ui.start()
    try:
        wait_until(
            lambda: get(ui.url, "/api/cameras").json()["events"]["stored"] == len(uids),
            20,
            what=f"{len(uids)} events after the restart",
        )
        ids = event_ids(ui.url)
    finally:
        ui.stop()
    assert len(uids) == 24
    assert Counter(ids) == Counter(uids)  # each exactly once
    assert group_pending(redis_server.client(), config) == 0


def test_entries_that_are_not_descriptions_are_acknowledged_and_counted(config, ui, redis_server):
    client = redis_server.client()
    stream = config.queue.descriptions_stream
    client.xadd(stream, {"frame_id": "1-0", "camera": "door", "reason": "max_age"})
    client.xadd(stream, {"frame_id": "2-0", "camera": "door"})
    describe(config, ["after the odd ones"])
    wait_until(lambda: ui.store.count_events() == 1, 10, what="the description stored")
    wait_until(lambda: group_pending(client, config) == 0, 5, what="all acked")
    counters = ui.store.counters()
    assert counters["skipped:max_age"] == 1 and counters["skipped:no_text"] == 1


def test_an_event_whose_jpeg_expired_is_stored_without_a_snapshot(config, start_ui, redis_server):
    (uid,) = describe(config, ["the picture is gone"])
    client = redis_server.client()
    client.delete(f"{config.queue.image_prefix}{uid}")  # its TTL ran out before the ui read it
    ui = start_ui(config)
    wait_until(lambda: ui.store.count_events() == 1, 10, what="event stored")
    event = get(ui.url, f"/api/events/{uid}").json()
    assert event["text"] == "the picture is gone" and not event["has_snapshot"]
    assert ui.store.counters()["snapshot_missing"] == 1
    assert get(ui.url, f"/api/events/{uid}/snapshot.jpg").status_code == 404


def test_the_consumer_rides_out_a_redis_restart(config, ui, redis_server):
    """Redis killed (AOF, fsync always) and back: the consumer reconnects, nothing is lost."""
    first = describe(config, ["before the outage"])
    wait_until(lambda: ui.store.count_events() == 1, 10, what="first event")
    redis_server.restart(down_for=1.0)
    second = describe(config, ["after the outage"])
    wait_until(lambda: ui.store.count_events() == 2, 15, what="event after the restart")
    assert sorted(event_ids(ui.url)) == sorted(first + second)
    assert get(ui.url, "/health").json() == {"status": "ok", "redis_connected": True}
