"""Retention: events older than ``retain_days`` go, and per camera the oldest go while its
snapshots take more than ``max_snapshot_mb``.

Whole events are deleted (row, history, index entry and both files), oldest capture time
first, and counted ``deleted:age`` / ``deleted:disk`` in the store's counters. The API reads
only the table, so a deleted event is never returned. The budget is computed from the sizes
recorded at write time (``snapshot_bytes``), not by walking the disk.
"""

from __future__ import annotations

import logging
import sqlite3
import time

from pipelines.events.config import EventsConfig
from pipelines.events.store import EventStore
from pipelines.logs import kv
from pipelines.worker import ThreadWorker

log = logging.getLogger(__name__)


def enforce_retention(
    store: EventStore, cfg: EventsConfig, now: float | None = None
) -> dict[str, int]:
    """One pass over every camera with events; returns what was deleted, by reason."""
    now = time.time() if now is None else now
    deleted = {"age": 0, "disk": 0}
    for camera in store.cameras():
        days = cfg.retain_days_for(camera)
        if days is not None:
            cutoff = now - days * 86400.0
            while rows := store.older_than(camera, cutoff):
                deleted["age"] += store.delete(rows, "age")
        budget = cfg.max_snapshot_bytes_for(camera)
        if budget is None:
            continue
        excess = store.snapshot_usage(camera) - budget
        while excess > 0:
            rows = store.oldest_with_snapshots(camera)
            if not rows:
                break
            victims = []
            for row in rows:
                if excess <= 0:
                    break
                victims.append(row)
                excess -= row["snapshot_bytes"]
            deleted["disk"] += store.delete(victims, "disk")
    for reason, n in deleted.items():
        if n:
            log.info(kv("events_deleted", reason=reason, events=n))
    return deleted


class RetentionLoop(ThreadWorker):
    """``enforce_retention`` every ``retention_interval_s`` on its own thread."""

    def __init__(self, store: EventStore, cfg: EventsConfig) -> None:
        self.store = store
        self.cfg = cfg
        self.passes = 0
        super().__init__("events-retention")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                enforce_retention(self.store, self.cfg)
            except (sqlite3.Error, OSError) as exc:  # retried on the next pass
                log.error(kv("retention_failed", error=exc))
            self.passes += 1
            self._stop.wait(self.cfg.retention_interval_s)
