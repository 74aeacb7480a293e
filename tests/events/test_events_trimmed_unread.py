"""Descriptions trimmed from the stream before the events group read them are counted.

The describers append with ``XADD MAXLEN ~ descriptions_maxlen``; a ui that is down for longer
than that many descriptions never sees the oldest ones. Each entry carries its number ``n``
(``COMMIT_LUA``), the consumer keeps the highest it read in the store, and a jump is counted
``lost:trimmed_unread``: every description written is either an event or counted.

Real redis-server (``stream-node-max-entries`` lowered so that ``MAXLEN ~ 10`` trims at
once), the real ui on uvicorn, descriptions committed with the describers' Lua script.
"""

from __future__ import annotations

import time

import pytest

from tests.events.events_helpers import describe, get, make_config
from tests.pipelines.pipeline_helpers import wait_until

pytestmark = pytest.mark.timeout(60)


def settled(ui, written: int) -> bool:
    counters = ui.store.counters()
    return ui.store.count_events() + counters.get("lost:trimmed_unread", 0) == written


def test_descriptions_trimmed_while_the_ui_was_down_are_counted(redis_server, tmp_path, start_ui):
    config = make_config(redis_server.url, tmp_path / "events", queue={"descriptions_maxlen": 10})
    client = redis_server.client()
    client.config_set("stream-node-max-entries", 5)  # MAXLEN ~ trims whole nodes of 5

    ui = start_ui(config)
    describe(config, ["before the outage 1", "before the outage 2"])
    wait_until(lambda: ui.store.count_events() == 2, 10, what="2 events")
    ui.stop()

    describe(config, [f"while the ui is down {i}" for i in range(40)])
    assert client.xlen(config.queue.descriptions_stream) < 40  # the oldest are gone

    ui = start_ui(config)  # same data dir: it remembers the last number it read
    wait_until(lambda: settled(ui, 42), 15, what="events + lost:trimmed_unread == 42")
    lost = ui.store.counters()["lost:trimmed_unread"]
    assert lost > 0 and ui.store.count_events() == 42 - lost
    body = get(ui.url, "/api/cameras").json()
    assert body["events"]["counters"]["lost:trimmed_unread"] == lost

    describe(config, ["after the restart"])  # no gap: nothing more is counted
    wait_until(lambda: settled(ui, 43), 10, what="the next description stored")
    assert ui.store.counters()["lost:trimmed_unread"] == lost


def test_entries_without_a_number_are_not_checked(config, ui, redis_server):
    """An older describer writes no ``n``: its entries are stored, no gap is counted."""
    client = redis_server.client()
    stream = config.queue.descriptions_stream
    for i in range(3):
        fields = {"frame_uid": f"old:{i}", "camera": "door", "ts": f"{time.time():.3f}"}
        client.xadd(stream, {**fields, "text": "an older describer's entry"})
    describe(config, ["a numbered one"])
    wait_until(lambda: ui.store.count_events() == 4, 10, what="4 events")
    assert "lost:trimmed_unread" not in ui.store.counters()
