"""The notifier loop: descriptions stream -> every sink, acknowledged per sink.

Each sink reads the descriptions stream through its own consumer group,
``<notify.group>:<sink>`` (``notifiers:mqtt``, ``notifiers:webhook:<name>``), so:

- an entry is acknowledged in a sink's group only once that sink has it (delivered, or
  dead-lettered with a reason) -- at least once, per sink;
- a sink's progress is Redis's own record of that group: a restarted notifier re-sends
  only what that sink had not confirmed (its pending entries, read again first), never
  what it had;
- a slow or dead sink holds back only its own group: a broker that is down for an hour does
  not delay the webhooks, and the reverse.

The groups are made from id 0 the first time a notifier runs (no ``<group>:*`` group on the
stream yet), so descriptions written before it started are sent too; a sink added to the
file later starts with new descriptions rather than replaying the stream's history to it.
Groups of sinks no longer configured are left alone (logged at start; ``XGROUP DESTROY``).

Everything else follows ``describe.py``: consumer ``notify.consumer`` (default the
hostname), claims renewed on in-flight entries, ``XAUTOCLAIM`` of entries idle past
``claim_idle_s`` (another notifier died), Redis down = retry with backoff, ``NOGROUP`` = make
the group again. Acknowledging is one Lua script that counts only if the ``XACK`` took, so a
retried acknowledgement never counts twice.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import redis

from pipelines.backoff import Backoff
from pipelines.config import PipelineConfig
from pipelines.logs import kv
from pipelines.notify import metrics
from pipelines.notify.event import build_event, skip_reason
from pipelines.notify.sink import Dead, Delivered, Hooks, Sink
from pipelines.worker import REDIS_DOWN, RedisWorker, Stopping, connect_async, renew_claims

log = logging.getLogger(__name__)

ACK_LUA = """
-- KEYS: descriptions stream, stats hash, dead-letter stream
-- ARGV: group, entry id, dead-letter maxlen, number of counters n,
--       then n counter/increment pairs, then the dead letter's field/value pairs (if any)
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
local n = tonumber(ARGV[4])
for i = 0, n - 1 do
  local by = tonumber(ARGV[6 + 2 * i])
  if by ~= 0 then redis.call('HINCRBY', KEYS[2], ARGV[5 + 2 * i], by) end
end
local fields = {}
for i = 5 + 2 * n, #ARGV do fields[#fields + 1] = ARGV[i] end
if #fields > 0 then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', unpack(fields))
end
return 1
"""


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def build_sinks(config: PipelineConfig, hooks: Hooks) -> list[Sink]:
    """The configured sinks: MQTT first, then the webhooks in file order."""
    from pipelines.notify.mqtt import MqttSink
    from pipelines.notify.webhook import WebhookSink

    n = config.notify
    sinks: list[Sink] = []
    if n.mqtt is not None:
        cameras = [c.id for c in config.cameras]
        backoff = (n.backoff_initial_s, n.backoff_max_s)
        sinks.append(MqttSink(n.mqtt, cameras, hooks, n.concurrency, *backoff))
    for hook in n.webhooks:
        secret = n.webhook_secret(hook)
        sinks.append(
            WebhookSink(hook, secret, hooks, n.backoff_initial_s, n.backoff_max_s, n.concurrency)
        )
    return sinks


class Notifier(RedisWorker):
    """One process: a ``SinkWorker`` per sink, sharing a Redis client and the stop signal."""

    def __init__(
        self, config: PipelineConfig, consumer: str | None = None, sinks: list[Sink] | None = None
    ) -> None:
        self.config = config
        self.n = config.notify
        super().__init__(
            "notifier", metrics.REDIS_ERRORS, self.n.backoff_initial_s, self.n.backoff_max_s
        )
        self.stream = config.queue.descriptions_stream
        self.consumer = consumer or self.n.consumer or socket.gethostname()
        self.redis = connect_async(config.redis_url, self.n.block_ms)
        self.ack_script = self.redis.register_script(ACK_LUA)
        self.hooks = Hooks(sleep=self.sleep, stopped=self.wait_for_stop, retry=self._retry)
        self.sinks = sinks if sinks is not None else build_sinks(config, self.hooks)

    def group(self, sink: Sink) -> str:
        return f"{self.n.group}:{sink.name}"

    # -- lifecycle (stop requests, sleeps, Redis retries: ``RedisWorker``) ---------------
    async def run(self) -> None:
        """Deliver until ``request_stop()``; in-flight events get ``shutdown_grace_s``."""
        self._started()
        names = ",".join(s.name for s in self.sinks)
        log.info(kv("notifier_started", consumer=self.consumer, sinks=names))
        workers = [SinkWorker(self, sink) for sink in self.sinks]
        tasks: list[asyncio.Task[None]] = []
        try:
            for sink in self.sinks:
                await sink.start()
            await self.with_redis(self.ensure_groups)
            tasks = [asyncio.create_task(w.run(), name=w.group) for w in workers]
            await asyncio.gather(*tasks)
        except Stopping:
            pass
        finally:
            self.request_stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            for sink in self.sinks:
                await sink.close()
            await self.redis.aclose()
            counts = {f"{w.sink.name}.{k}": v for w in workers for k, v in w.counts.items()}
            log.info(kv("notifier_stopped", consumer=self.consumer, **counts))

    # -- Redis helpers -------------------------------------------------------------------
    async def ensure_groups(self, only: Sink | None = None) -> None:
        """Make missing groups: from id 0 on the first run, from new entries for a sink
        added later (see the module docstring)."""
        prefix = f"{self.n.group}:"
        try:
            existing = {_s(g["name"]) for g in await self.redis.xinfo_groups(self.stream)}
        except redis.ResponseError:  # no stream yet
            existing = set()
        ours = {g for g in existing if g.startswith(prefix)}
        wanted = {self.group(s) for s in self.sinks}
        if only is None:
            for unused in sorted(ours - wanted):
                log.warning(kv("notify_group_unused", stream=self.stream, group=unused))
        for sink in self.sinks if only is None else [only]:
            group = self.group(sink)
            if group in existing:
                continue
            start = "$" if ours else "0"  # a notifier ran here before: a sink added since
            try:
                await self.redis.xgroup_create(self.stream, group, id=start, mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
                continue
            origin = "history" if start == "0" else "new entries"
            log.info(kv("notify_group_created", group=group, start=origin))

    def _retry(self, sink: str, reason: str) -> None:
        metrics.RETRIES.labels(sink, reason).inc()
        metrics.SINK_UP.labels(sink).set(0)


class SinkWorker:
    """One sink's read loop over its consumer group, ``notify.concurrency`` events at once."""

    def __init__(self, notifier: Notifier, sink: Sink) -> None:
        self.notifier = notifier
        self.n = notifier.n
        self.redis = notifier.redis
        self.stream = notifier.stream
        self.sink = sink
        self.group = notifier.group(sink)
        self.consumer = notifier.consumer
        self.inflight: dict[str, asyncio.Task[None]] = {}
        self.counts: dict[str, int] = {}
        self._history: str | None = "0-0"  # our own pending entries are read again first
        self._claim_cursor = "0-0"

    async def run(self) -> None:
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            await self._loop()
        except Stopping:
            pass
        finally:
            await self._drain()
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)

    async def _loop(self) -> None:
        backoff = Backoff(self.n.backoff_initial_s, self.n.backoff_max_s)
        last_claim = 0.0
        while not self.notifier.stopping:
            try:
                if time.monotonic() - last_claim >= self.n.claim_interval_s:
                    last_claim = time.monotonic()
                    await self._reclaim()
                    await self._observe()
                free = self.n.concurrency - len(self.inflight)
                if free <= 0:
                    await self._wait_for_slot()
                    continue
                history = self._history is not None
                reply = await self.redis.xreadgroup(
                    self.group,
                    self.consumer,
                    {self.stream: self._history if history else ">"},
                    count=free,
                    block=None if history else self.n.block_ms,
                )
                if backoff.attempts:
                    log.info(kv("redis_connected", component="notifier", sink=self.sink.name))
                backoff.reset()
                entries = [e for _stream, batch in reply or [] for e in batch]
                if history:
                    if not entries:
                        self._history = None
                    else:
                        self._history = _s(entries[-1][0])
                        log.info(kv("notify_resumed", sink=self.sink.name, pending=len(entries)))
                for entry_id, fields in entries:
                    if _s(entry_id) not in self.inflight:
                        self._spawn(_s(entry_id), fields)
            except REDIS_DOWN as exc:
                await self.notifier.redis_down(exc, backoff)
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):  # Redis lost its data: the stream starts again
                    log.warning(kv("group_missing", stream=self.stream, group=self.group))
                    await self.notifier.with_redis(lambda: self.notifier.ensure_groups(self.sink))
                    continue
                log.error(kv("redis_refused", component="notifier", error=exc))
                metrics.REDIS_ERRORS.inc()
                await self.notifier.sleep(backoff.next_delay())

    async def _wait_for_slot(self) -> None:
        stop = asyncio.ensure_future(self.notifier.wait_for_stop())
        try:
            await asyncio.wait(
                [*self.inflight.values(), stop],
                timeout=self.n.block_ms / 1000,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            stop.cancel()

    async def _drain(self) -> None:
        """Give in-flight events ``shutdown_grace_s``; the rest stay pending for next time."""
        tasks = list(self.inflight.values())
        if not tasks:
            return
        _done, still = await asyncio.wait(tasks, timeout=self.n.shutdown_grace_s)
        for task in still:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        left = sum(1 for t in tasks if t.cancelled() or isinstance(t.exception(), Stopping))
        if left:
            log.info(kv("left_pending", sink=self.sink.name, events=left))

    # -- reclaiming and observing --------------------------------------------------------
    async def _heartbeat(self) -> None:
        """Renew the claim on in-flight entries: a live notifier's events never look
        abandoned, however long a sink keeps retrying."""
        await renew_claims(
            self.redis,
            self.stream,
            self.group,
            self.consumer,
            self.inflight,
            self.n.claim_idle_s,
            sink=self.sink.name,
        )

    async def _reclaim(self) -> None:
        """Take over entries idle past ``claim_idle_s`` (their notifier died)."""
        free = self.n.concurrency - len(self.inflight)
        if free <= 0:
            return
        reply = await self.redis.xautoclaim(
            self.stream,
            self.group,
            self.consumer,
            int(self.n.claim_idle_s * 1000),
            start_id=self._claim_cursor,
            count=free,
        )
        self._claim_cursor = _s(reply[0])
        for _entry_id in reply[2] if len(reply) > 2 else []:  # trimmed while pending
            await self._record(None, "skipped", "trimmed", {})
        for entry_id, fields in reply[1] or []:
            entry_id = _s(entry_id)
            if entry_id in self.inflight:
                continue
            log.info(kv("event_reclaimed", sink=self.sink.name, entry=entry_id))
            self._spawn(entry_id, fields)

    async def _observe(self) -> None:
        try:
            groups = await self.redis.xinfo_groups(self.stream)
        except redis.ResponseError:
            return
        for g in groups:
            if _s(g["name"]) == self.group:
                metrics.PENDING.labels(self.sink.name).set(int(g.get("pending") or 0))
                if g.get("lag") is not None:
                    metrics.LAG.labels(self.sink.name).set(int(g["lag"]))

    # -- one event -----------------------------------------------------------------------
    def _spawn(self, entry_id: str, raw: dict[bytes, bytes] | None) -> None:
        fields = {_s(k): _s(v) for k, v in raw.items()} if raw else None
        task = asyncio.create_task(self._process(entry_id, fields))
        self.inflight[entry_id] = task
        metrics.INFLIGHT.labels(self.sink.name).set(len(self.inflight))
        task.add_done_callback(lambda _t, i=entry_id: self._done(i))

    def _done(self, entry_id: str) -> None:
        task = self.inflight.pop(entry_id, None)
        metrics.INFLIGHT.labels(self.sink.name).set(len(self.inflight))
        if task is not None and not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if not isinstance(exc, Stopping):  # a bug: the entry stays pending, retried later
                failed = kv(
                    "event_task_failed", sink=self.sink.name, entry=entry_id, error=repr(exc)
                )
                log.error(failed)

    async def _process(self, entry_id: str, fields: dict[str, str] | None) -> None:
        if fields is None:  # deleted from the stream while pending
            await self._record(entry_id, "skipped", "trimmed", {})
            return
        reason = skip_reason(fields)
        if reason is not None:
            await self._record(entry_id, "skipped", reason, fields)
            return
        event = build_event(entry_id, fields)
        max_age = self.n.max_event_age_s
        if max_age is not None and time.time() - event.ts > max_age:
            await self._record(entry_id, "skipped", "stale", fields, event_id=event.event_id)
            return
        result = await self.sink.deliver(event)
        if isinstance(result, Delivered):
            await self._record(entry_id, "delivered", "ok", fields, event.event_id, result.attempts)
            described_at = float(fields.get("described_at") or 0) or time.time()
            metrics.LATENCY.labels(self.sink.name).observe(max(0.0, time.time() - described_at))
        else:
            assert isinstance(result, Dead)
            await self._record(
                entry_id,
                "dead",
                result.reason,
                fields,
                event.event_id,
                result.attempts,
                result.detail,
            )

    async def _record(
        self,
        entry_id: str | None,
        outcome: str,
        reason: str,
        fields: dict[str, str],
        event_id: str = "",
        attempts: int = 0,
        detail: str = "",
    ) -> None:
        """Acknowledge and count in one script (only if the ack took); dead letters too."""
        sink = self.sink.name
        stat = {
            "delivered": f"delivered:{sink}",
            "dead": f"dead:{sink}:{reason}",
            "skipped": f"skipped:{sink}:{reason}",
        }[outcome]
        counters = [stat, "1", f"retries:{sink}", str(max(0, attempts - 1))]
        letter: list[str] = []
        if outcome == "dead":
            letter = [
                "event_id", event_id,
                "entry_id", entry_id or "",
                "camera", fields.get("camera", ""),
                "sink", sink,
                "reason", reason,
                "detail", detail[:500],
                "attempts", str(attempts),
                "ts", f"{time.time():.6f}",
            ]  # fmt: skip
        if entry_id is not None:
            args = [self.group, entry_id, str(self.n.dead_letter_maxlen), "2", *counters, *letter]
            keys = [self.stream, self.n.stats_key, self.n.dead_letter_stream]
            acked = await self.notifier.with_redis(
                lambda: self.notifier.ack_script(keys=keys, args=args)
            )
            if not acked:  # another notifier finished it first (a reclaim race)
                return
        else:  # XAUTOCLAIM already dropped it from the pending list
            await self.notifier.with_redis(lambda: self.redis.hincrby(self.n.stats_key, stat, 1))
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        camera = fields.get("camera", "?")
        line: dict[str, Any] = {"sink": sink, "id": event_id or entry_id, "camera": camera}
        if outcome == "delivered":
            metrics.DELIVERED.labels(sink).inc()
            metrics.SINK_UP.labels(sink).set(1)
            log.info(kv("event_delivered", **line, attempts=attempts))
        elif outcome == "dead":
            metrics.DEAD.labels(sink, reason).inc()
            line.update(reason=reason, attempts=attempts, detail=detail[:200])
            log.warning(kv("event_dead", **line))
        else:
            metrics.SKIPPED.labels(sink, reason).inc()
            log.info(kv("event_skipped", **line, reason=reason))
