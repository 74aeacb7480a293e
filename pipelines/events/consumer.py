"""Descriptions stream -> event store, exactly once per described frame.

Delivery contract (why each piece exists):

- Its own consumer group (``events.group``) on ``queue.descriptions_stream``, created from id
  0: descriptions written before the ui ever ran are stored too, and the describers' own
  group is untouched.
- A batch is read with ``XREADGROUP``, written to SQLite (snapshots first, then the rows, one
  transaction) and acknowledged with ``XACK`` only after the commit. A crash in between
  leaves the entries pending; they are delivered again and the insert, keyed on the frame's
  ``frame_uid``, adds nothing (counted ``duplicate``). At-least-once + idempotent insert =
  one event per frame.
- On start, and after every Redis outage, the consumer first reads its own pending entries
  (id ``0``): a restarted ui under the same ``events.consumer`` name finishes what its
  predecessor read but did not acknowledge. ``XAUTOCLAIM`` takes over entries left idle by
  a consumer under another name (the name was changed, or two uis ran).
- The snapshot is the frame's JPEG, read from its Redis key (``image``), which expires
  ``queue.image_ttl_s`` after enqueue. An event whose JPEG is gone is stored without one
  (counted ``snapshot_missing``) rather than lost.
- Entries that are not descriptions (expired frames carry ``reason`` and no ``text``) are
  acknowledged and counted ``skipped:<reason>``; entries trimmed from the stream before they
  were read back are counted ``lost:trimmed``.
- Entries trimmed before this group ever read them (the ui was down longer than
  ``queue.descriptions_maxlen`` descriptions) leave no trace in the stream, so each entry
  carries ``n``, its number in the stream (``COMMIT_LUA``). The highest ``n`` read is kept in
  the store (mark ``descriptions_n``, committed with the events), and a jump of more than one
  is counted ``lost:trimmed_unread`` (less any pending entries of that stretch already counted
  ``lost:trimmed``) and logged. Entries without ``n`` (older describers) are not checked; a
  newly delivered ``n`` at or below the mark means Redis lost its counter: numbering restarts.
  This assumes one consumer per group: two uis sharing ``events.group`` each see part of the
  stream and would count the other's entries as gaps (give each ui its own group).
- Redis or the disk failing: nothing is acknowledged, the batch is retried with backoff.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import cv2
import redis

from pipelines.backoff import Backoff
from pipelines.config import PipelineConfig
from pipelines.events.store import EventStore, NewEvent
from pipelines.logs import kv
from pipelines.queue import REDIS_DOWN, connect
from pipelines.worker import ThreadWorker, log_redis_down

log = logging.getLogger(__name__)


N_MARK = "descriptions_n"  # store mark: the highest entry number (``n``) read


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _number(value: str | None) -> int | None:
    """An entry's ``n``; None when absent (an older writer) or not a positive integer."""
    try:
        n = int(value) if value else None
    except ValueError:
        return None
    return n if n is not None and n > 0 else None


class EventConsumer(ThreadWorker):
    """One thread: read descriptions, store them, acknowledge; ``on_stored`` is called (from
    this thread) after each commit that added events."""

    def __init__(
        self,
        config: PipelineConfig,
        store: EventStore,
        on_stored: Callable[[], None] | None = None,
    ) -> None:
        self.q = config.queue
        self.e = config.events
        self.store = store
        self.on_stored = on_stored
        self.client = connect(config.redis_url, self.e.block_ms)
        self.consumer = self.e.consumer
        self.connected = False
        self.counts: Counter[str] = Counter()  # this process's, for logs; the store has totals
        super().__init__("events-consumer")
        self._backlog = True  # read our own pending entries first
        self._backlog_cursor = "0"
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._high = store.mark(N_MARK) or 0  # highest ``n`` committed to the store
        self._trimmed_in_gap = 0  # pending entries counted lost:trimmed since that n

    # -- lifecycle (start, alive: ``ThreadWorker``) ----------------------------------------
    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        self.client.close()

    def _run(self) -> None:
        log.info(kv("events_consumer_started", group=self.e.group, consumer=self.consumer))
        backoff = Backoff(self.e.backoff_initial_s, self.e.backoff_max_s)
        group_ready = False
        while not self._stop.is_set():
            try:
                if not group_ready:
                    self._ensure_group()
                    group_ready = True
                self._step()
                if not self.connected:
                    log.info(kv("redis_connected", component="events", consumer=self.consumer))
                self.connected = True
                backoff.reset()
            except REDIS_DOWN as exc:
                if self.connected or backoff.attempts == 0:
                    log_redis_down("events", exc)
                self._after_failure()
                if backoff.wait(self._stop):
                    break
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):  # Redis lost its data, or the stream was deleted
                    log.warning(kv("group_missing", stream=self.q.descriptions_stream))
                    group_ready = False
                else:  # e.g. MISCONF / OOM: Redis refuses for now
                    log.error(kv("redis_refused", component="events", error=exc))
                self._after_failure()
                if backoff.wait(self._stop):
                    break
            except (sqlite3.Error, OSError) as exc:  # disk full, locked too long...
                log.error(kv("event_store_failed", error=exc))
                self._after_failure()
                if backoff.wait(self._stop):
                    break
        log.info(kv("events_consumer_stopped", consumer=self.consumer, **self.counts))

    def _after_failure(self) -> None:
        # what was read but not acknowledged is pending: read it again first
        self.connected = False
        self._backlog = True
        self._backlog_cursor = "0"

    def _ensure_group(self) -> None:
        try:
            self.client.xgroup_create(
                self.q.descriptions_stream, self.e.group, id="0", mkstream=True
            )
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- one step ------------------------------------------------------------------------------
    def _step(self) -> None:
        if time.monotonic() >= self._next_claim:
            self._next_claim = time.monotonic() + self.e.claim_interval_s
            self._reclaim()
        if self._backlog:
            reply = self.client.xreadgroup(
                self.e.group,
                self.consumer,
                {self.q.descriptions_stream: self._backlog_cursor},
                count=self.e.batch,
            )
            entries = reply[0][1] if reply else []
            if not entries:
                self._backlog = False
                return
            self._backlog_cursor = _s(entries[-1][0])
            self.handle(entries)
            return
        reply = self.client.xreadgroup(
            self.e.group,
            self.consumer,
            {self.q.descriptions_stream: ">"},
            count=self.e.batch,
            block=self.e.block_ms,
        )
        for _stream, entries in reply or []:
            self.handle(entries, new=True)

    def _reclaim(self) -> None:
        """Take over entries idle past ``claim_idle_s`` under another consumer name."""
        reply = self.client.xautoclaim(
            self.q.descriptions_stream,
            self.e.group,
            self.consumer,
            int(self.e.claim_idle_s * 1000),
            start_id=self._claim_cursor,
            count=self.e.batch,
        )
        self._claim_cursor = _s(reply[0])
        deleted = reply[2] if len(reply) > 2 else []
        if deleted:  # XAUTOCLAIM already dropped them from the pending list
            self.store.count(Counter({"lost:trimmed": len(deleted)}))
            self._trimmed_in_gap += len(deleted)
        entries = [(i, f) for i, f in reply[1] or [] if f is not None]
        if entries:
            log.info(kv("events_reclaimed", entries=len(entries), consumer=self.consumer))
            self.handle(entries)

    def handle(self, entries: list[tuple[Any, Any]], new: bool = False) -> None:
        """Store a batch of stream entries, then acknowledge them all. ``new``: newly
        delivered (``>``), not re-read from a pending list."""
        counts: Counter[str] = Counter()
        events: dict[str, NewEvent] = {}
        images: dict[str, str] = {}  # event id -> Redis key of its JPEG
        ack: list[str] = []
        high, trimmed_in_gap = self._high, self._trimmed_in_gap
        for raw_id, raw in entries:
            entry_id = _s(raw_id)
            ack.append(entry_id)
            if not raw:  # read back from the pending list after it was trimmed away
                counts["lost:trimmed"] += 1
                trimmed_in_gap += 1
                continue
            f = {_s(k): _s(v) for k, v in raw.items()}
            n = _number(f.get("n"))
            if n is not None and n > high:
                gap = max(0, n - high - 1 - trimmed_in_gap)
                if gap:
                    counts["lost:trimmed_unread"] += gap
                    log.warning(kv("descriptions_trimmed_unread", entries=gap, after_n=high,
                                   next_n=n, group=self.e.group))  # fmt: skip
                high, trimmed_in_gap = n, 0
            elif n is not None and new:  # never delivered, yet not above the mark
                log.info(kv("descriptions_numbering_restarted", n=n, mark=high))
                high, trimmed_in_gap = n, 0
            if "text" not in f:
                counts[f"skipped:{f.get('reason') or 'no_text'}"] += 1
                continue
            event = NewEvent.from_entry(entry_id, f)
            if event.id in events:
                counts["duplicate"] += 1
                continue
            events[event.id] = event
            images[event.id] = f.get("image", "")
        stored = self.store.existing(events)
        fresh = [e for i, e in events.items() if i not in stored]
        counts["duplicate"] += len(stored)
        self._snapshots(fresh, images, counts)
        marks = {N_MARK: high} if high != self._high else {}
        seqs = self.store.add(fresh, counts, marks) if fresh or counts or marks else []
        self._high, self._trimmed_in_gap = high, trimmed_in_gap
        if ack:
            self.client.xack(self.q.descriptions_stream, self.e.group, *ack)
        self.counts.update(counts)
        for event in fresh:
            log.debug(kv("event_stored", id=event.id, camera=event.camera))
        if seqs and self.on_stored is not None:
            self.on_stored()

    def _snapshots(
        self, events: list[NewEvent], images: dict[str, str], counts: Counter[str]
    ) -> None:
        if not self.e.snapshots:
            return
        wanted = [e for e in events if images.get(e.id)]
        counts["snapshot_missing"] += len(events) - len(wanted)
        jpegs = self.client.mget([images[e.id] for e in wanted]) if wanted else []
        for event, jpeg in zip(wanted, jpegs, strict=True):
            if jpeg is None:  # its TTL ran out before we read it
                counts["snapshot_missing"] += 1
                continue
            try:
                if not self.store.write_snapshots(event, jpeg, self.e.jpeg_quality):
                    counts["snapshot_undecodable"] += 1
            except (OSError, cv2.error) as exc:  # disk full: keep the text, count the picture
                log.warning(kv("snapshot_write_failed", id=event.id, error=exc))
                counts["snapshot_write_failed"] += 1
                event.snapshot = event.snapshot_boxes = None
                event.snapshot_bytes = 0
