"""Retention runs continuously inside the ui: by age (per-camera override) and by each
camera's snapshot budget. Deleted events leave the API, the index and the disk, counted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipelines.events.retention import enforce_retention
from tests.events.events_helpers import describe, event_ids, get, make_config
from tests.pipelines.pipeline_helpers import wait_until

pytestmark = pytest.mark.timeout(60)
DAY = 86400.0


def snapshot_files(data_dir: str) -> list[Path]:
    return sorted(p for p in Path(data_dir, "snapshots").rglob("*.jpg"))


def test_events_older_than_retain_days_are_deleted_with_their_files(
    redis_server, tmp_path, start_ui
):
    config = make_config(
        redis_server.url,
        tmp_path / "events",
        events={"retain_days": 2, "cameras": {"archive": {"retain_days": 30}}},
    )
    now = time.time()
    old = describe(config, ["an old visitor with a hat"], camera="door", ts=now - 5 * DAY)
    kept = describe(config, ["a recent visitor"], camera="door", ts=now - 1 * DAY)
    archived = describe(config, ["old but archived"], camera="archive", ts=now - 5 * DAY)
    ui = start_ui(config)
    wait_until(lambda: ui.store.counters().get("stored") == 3, 10, what="3 stored")
    wait_until(lambda: ui.store.counters().get("deleted:age") == 1, 5, what="age deletion")
    assert sorted(event_ids(ui.url)) == sorted(kept + archived)
    assert get(ui.url, f"/api/events/{old[0]}").status_code == 404
    assert get(ui.url, f"/api/events/{old[0]}/snapshot.jpg").status_code == 404
    assert get(ui.url, "/api/events", q="hat").json()["data"] == []
    assert len(snapshot_files(config.events.data_dir)) == 4  # two events x (raw + boxes)
    assert not any(old[0].split(":")[1] in p.name for p in snapshot_files(config.events.data_dir))


def test_a_camera_over_its_snapshot_budget_loses_its_oldest_events_first(
    redis_server, tmp_path, start_ui
):
    config = make_config(redis_server.url, tmp_path / "events", events={"max_snapshot_mb": 1})
    now = time.time()
    uids = []
    for i in range(6):
        uids += describe(config, [f"frame {i}"], camera="door", ts=now - 60 + i)
    yard = describe(config, ["other camera"], camera="yard", ts=now - 120)
    ui = start_ui(config)
    wait_until(lambda: ui.store.counters().get("stored") == 7, 10, what="7 stored")
    per_event = ui.store.snapshot_usage("door") // 6
    # budget for three and a half events: the three oldest of this camera must go
    budget = per_event * 3.5
    config.events.cameras = {"door": {"max_snapshot_mb": budget / (1024 * 1024)}}
    wait_until(lambda: ui.store.counters().get("deleted:disk") == 3, 5, what="disk deletions")
    assert sorted(event_ids(ui.url)) == sorted(uids[3:] + yard)  # the other camera untouched
    assert ui.store.snapshot_usage("door") <= budget
    assert len(snapshot_files(config.events.data_dir)) == 2 * 4


def test_retention_keeps_everything_within_its_limits(tmp_path):
    from pipelines.events.config import EventsConfig
    from pipelines.events.store import EventStore, NewEvent

    store = EventStore(tmp_path)
    now = time.time()
    store.add([NewEvent(id=f"c:r:{i}", camera="c", ts=now - i * DAY, text="t") for i in range(3)])
    cfg = EventsConfig(retain_days=None, max_snapshot_mb=None)
    assert enforce_retention(store, cfg, now) == {"age": 0, "disk": 0}
    assert enforce_retention(store, EventsConfig(retain_days=1.5), now) == {"age": 1, "disk": 0}
    assert store.count_events() == 2
