"""Describer workers: frames from the Redis consumer group -> VLM -> descriptions.

Delivery contract (why each piece exists):

- ``XREADGROUP`` hands each new frame to one worker; it stays *pending* until that worker
  commits. Commit = one Lua script (``queue.COMMIT_LUA``): ``XACK`` and, only if the ack
  took, store the result -- so a frame is never recorded twice, even when two workers raced.
- A worker renews its claim on the frames it is working on (``XCLAIM ... JUSTID``, which
  resets the idle time without counting a delivery). So frames sit idle only when their
  worker is dead or stopped, and ``XAUTOCLAIM`` after ``claim_idle_s`` hands them to a live
  worker however slow the VLM is.
- Each reclaim counts a delivery; past ``max_deliveries`` (a frame that keeps killing its
  workers) it goes to the dead-letter stream instead.
- Frames older than ``max_frame_age_s`` are acknowledged as expired, never sent.
- A clip entry (``describer.view: clip``) is one frame for all of the above: its frames
  come from its clip key (``queue.encode_clip``), go out as one video part (``vlm``), and
  the clip key is deleted with the result; the ``image`` key (the clip's last frame) stays
  as the event's snapshot.
- Several endpoints (``describer.endpoints``, ``pipelines.endpoints``): each request goes to
  the least loaded endpoint in rotation. One that is down (refused, timeout, 429, 503...) is
  taken out of rotation and the frame is sent to another at once -- the endpoint's failure,
  not the frame's: nothing is counted against the frame, and it stays pending under this
  worker until one result is committed, so the exactly-once accounting is untouched.
- Every endpoint down: the frame waits (retried when one comes back) and the worker takes at
  most one frame at a time until one answers again; the rest wait in the stream and expire
  by age when they are finally read. Counted, no crash.
- Endpoint up but failing on a frame (HTTP 500...): retried with backoff, and after
  ``max_failures`` such answers the frame is dead-lettered (``dead:server_error``) rather
  than retried as an outage until it expires.
- Every outcome is counted in the stats hash so that ``queue.IDENTITY`` holds.
- Redis down: every Redis call is retried with backoff; the worker keeps running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections import Counter
from typing import Any

import redis

from pipelines import metrics
from pipelines.backoff import Backoff
from pipelines.config import PipelineConfig
from pipelines.endpoints import EndpointPool
from pipelines.logs import kv
from pipelines.queue import COMMIT_LUA
from pipelines.vlm import (
    EndpointUnavailable,
    FrameRejected,
    ServerError,
    frame_request,
    split_clip,
)
from pipelines.worker import REDIS_DOWN, RedisWorker, Stopping, connect_async, renew_claims

log = logging.getLogger(__name__)


def default_consumer_name() -> str:
    """Unique per process, so a restarted worker never inherits a dead one's pending list."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Describer(RedisWorker):
    """One worker process's loop: read, describe with bounded concurrency, commit."""

    def __init__(
        self,
        config: PipelineConfig,
        consumer: str | None = None,
        pool: EndpointPool | None = None,
    ) -> None:
        self.config = config
        self.q = config.queue
        self.d = config.describer
        super().__init__(
            "describer",
            metrics.REDIS_ERRORS.labels("describer"),
            self.d.backoff_initial_s,
            self.d.backoff_max_s,
        )
        self.consumer = consumer or default_consumer_name()
        self.redis = connect_async(config.redis_url, self.d.block_ms)
        self._commit_script = self.redis.register_script(COMMIT_LUA)
        self.pool = pool or EndpointPool(self.d)
        self.inflight: dict[str, asyncio.Task[None]] = {}
        self.counts: Counter[str] = Counter()
        self._claim_cursor = "0-0"
        self._last_gc = 0.0

    # -- lifecycle (stop requests, sleeps, Redis retries: ``RedisWorker``) ---------------
    async def run(self) -> None:
        """Work until ``request_stop()``; then finish in-flight frames within the grace."""
        self._started()
        names = ",".join(ep.name for ep in self.pool.endpoints)
        log.info(
            kv("describer_started", consumer=self.consumer, model=self.d.model, endpoints=names)
        )
        heartbeat = asyncio.create_task(self._heartbeat())
        probes = asyncio.create_task(self.pool.run())
        try:
            await self.with_redis(self._ensure_group)
            await self._loop_frames()
        except Stopping:
            pass
        finally:
            await self._drain()
            heartbeat.cancel()
            probes.cancel()
            await asyncio.gather(heartbeat, probes, return_exceptions=True)
            await self.pool.close()
            await self.redis.aclose()
            log.info(kv("describer_stopped", consumer=self.consumer, **self.counts))

    async def _loop_frames(self) -> None:
        backoff = Backoff(self.d.backoff_initial_s, self.d.backoff_max_s)
        last_claim = 0.0
        while not self.stopping:
            try:
                if time.monotonic() - last_claim >= self.d.claim_interval_s:
                    last_claim = time.monotonic()
                    await self._reclaim()
                    await self._observe_queue()
                free = self._capacity() - len(self.inflight)
                if free <= 0:
                    await self._wait_for_slot()
                    continue
                reply = await self.redis.xreadgroup(
                    self.q.group,
                    self.consumer,
                    {self.q.frames_stream: ">"},
                    count=free,
                    block=self.d.block_ms,
                )
                if backoff.attempts:
                    log.info(kv("redis_connected", component="describer", consumer=self.consumer))
                backoff.reset()
                for _stream, entries in reply or []:
                    for entry_id, fields in entries:
                        self._spawn(_s(entry_id), fields, deliveries=1)
            except REDIS_DOWN as exc:
                await self.redis_down(exc, backoff)
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):  # Redis lost its data (or someone deleted the stream)
                    log.warning(
                        kv("group_missing", stream=self.q.frames_stream, group=self.q.group)
                    )
                    await self.with_redis(self._ensure_group)
                    continue
                # e.g. MISCONF / OOM: Redis refuses for now; keep running, try again later
                log.error(kv("redis_refused", component="describer", error=exc))
                metrics.REDIS_ERRORS.labels("describer").inc()
                await self.sleep(backoff.next_delay())

    @property
    def endpoint_ok(self) -> bool:
        """Some endpoint is in rotation."""
        return self.pool.any_up

    def _capacity(self) -> int:
        # while every endpoint fails, one frame at a time waits for one; the rest wait in Redis
        return self.d.concurrency if self.pool.any_up else 1

    async def _wait_for_slot(self) -> None:
        waiters = [*self.inflight.values(), asyncio.ensure_future(self.wait_for_stop())]
        try:
            await asyncio.wait(
                waiters, timeout=self.d.block_ms / 1000, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiters[-1].cancel()

    async def _drain(self) -> None:
        """Give in-flight frames ``shutdown_grace_s`` to finish; the rest stay pending."""
        self.request_stop()
        tasks = list(self.inflight.values())
        if tasks:
            log.info(kv("describer_draining", consumer=self.consumer, inflight=len(tasks)))
            _done, still = await asyncio.wait(tasks, timeout=self.d.shutdown_grace_s)
            for task in still:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if still:  # not acknowledged: another worker reclaims them after claim_idle_s
                log.warning(kv("left_pending", consumer=self.consumer, frames=len(still)))

    # -- Redis helpers -------------------------------------------------------------------
    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(
                self.q.frames_stream, self.q.group, id="0", mkstream=True
            )
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- reclaiming and observing --------------------------------------------------------
    async def _heartbeat(self) -> None:
        """Renew the claim on in-flight frames so no live worker's frame looks abandoned."""
        await renew_claims(
            self.redis,
            self.q.frames_stream,
            self.q.group,
            self.consumer,
            self.inflight,
            self.d.claim_idle_s,
            consumer=self.consumer,
        )

    async def _reclaim(self) -> None:
        """Take over frames idle past ``claim_idle_s`` (their worker died) -- up to free slots."""
        free = self._capacity() - len(self.inflight)
        if free <= 0:
            return
        reply = await self.redis.xautoclaim(
            self.q.frames_stream,
            self.q.group,
            self.consumer,
            int(self.d.claim_idle_s * 1000),
            start_id=self._claim_cursor,
            count=free,
        )
        self._claim_cursor = _s(reply[0])
        entries = reply[1] or []
        deleted = reply[2] if len(reply) > 2 else []
        for entry_id in deleted:  # deleted from the stream while pending: count the loss
            await self._dead_deleted(_s(entry_id))
        for entry_id, fields in entries:
            entry_id = _s(entry_id)
            if entry_id in self.inflight or fields is None:
                continue
            info = await self.redis.xpending_range(
                self.q.frames_stream, self.q.group, min=entry_id, max=entry_id, count=1
            )
            deliveries = int(info[0]["times_delivered"]) if info else 1
            metrics.RECLAIMED.inc()
            self.counts["reclaimed"] += 1
            log.info(
                kv(
                    "frame_reclaimed",
                    id=entry_id,
                    camera=_s(fields.get(b"camera", b"?")),
                    deliveries=deliveries,
                    consumer=self.consumer,
                )
            )
            self._spawn(entry_id, fields, deliveries)
        await self._forget_idle_consumers()

    async def _dead_deleted(self, entry_id: str) -> None:
        """An entry XAUTOCLAIM found gone from the stream (the enqueue script never trims
        pending ones; someone deleted it): a dead letter with what is left, its id."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(
                self.q.dead_letter_stream,
                {"frame_id": entry_id, "reason": "trimmed_pending", "detail": "entry deleted"},
                maxlen=self.q.dead_letter_maxlen,
                approximate=True,
            )
            pipe.hincrby(self.q.stats_key, "dead:trimmed_pending", 1)
            await pipe.execute()
        self._count(entry_id, "?", "dead", "trimmed_pending")

    async def _forget_idle_consumers(self) -> None:
        """Bounded group state: drop consumers that own nothing and were idle for long."""
        if time.monotonic() - self._last_gc < 60:
            return
        self._last_gc = time.monotonic()
        for c in await self.redis.xinfo_consumers(self.q.frames_stream, self.q.group):
            name = _s(c["name"])
            idle_s = int(c["idle"]) / 1000
            if name != self.consumer and int(c["pending"]) == 0 and idle_s > self.d.consumer_gc_s:
                await self.redis.xgroup_delconsumer(self.q.frames_stream, self.q.group, name)

    async def _observe_queue(self) -> None:
        try:
            groups = await self.redis.xinfo_groups(self.q.frames_stream)
        except redis.ResponseError:  # stream gone (e.g. Redis lost its data): nothing to show
            return
        for g in groups:
            if _s(g["name"]) != self.q.group:
                continue
            metrics.QUEUE_PENDING.set(int(g.get("pending") or 0))
            if g.get("lag") is not None:
                metrics.QUEUE_LAG.set(int(g["lag"]))
            last = _s(g["last-delivered-id"])
            head = await self.redis.xrange(self.q.frames_stream, min=f"({last}", max="+", count=1)
            ts = float(head[0][1].get(b"ts", b"0")) if head else 0.0
            metrics.QUEUE_LAG_SECONDS.set(max(0.0, time.time() - ts) if ts else 0.0)

    # -- one frame -------------------------------------------------------------------------
    def _spawn(self, entry_id: str, raw: dict[bytes, bytes], deliveries: int) -> None:
        fields = {_s(k): _s(v) for k, v in raw.items()}
        task = asyncio.create_task(self._process(entry_id, fields, deliveries))
        self.inflight[entry_id] = task
        metrics.DESCRIBE_INFLIGHT.set(len(self.inflight))
        task.add_done_callback(lambda _t, i=entry_id: self._done(i))

    def _done(self, entry_id: str) -> None:
        task = self.inflight.pop(entry_id, None)
        metrics.DESCRIBE_INFLIGHT.set(len(self.inflight))
        if task is not None and not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if not isinstance(exc, Stopping):
                log.error(kv("frame_task_failed", id=entry_id, error=repr(exc)))

    async def _process(self, entry_id: str, fields: dict[str, str], deliveries: int) -> None:
        camera = fields.get("camera", "?")
        ts = float(fields.get("ts") or 0.0)
        if deliveries > self.d.max_deliveries:
            await self._finish(
                entry_id, fields, "dead", "max_deliveries", f"{deliveries} deliveries"
            )
            return
        if time.time() - ts > self.q.max_frame_age_s:
            await self._finish(entry_id, fields, "expired", "max_age")
            return
        image_key = fields.get("image", "")
        clip_key = fields.get("clip", "")
        if clip_key:
            jpeg, blob = await self.with_redis(lambda: self.redis.mget([image_key, clip_key]))
        else:
            jpeg, blob = await self.with_redis(lambda: self.redis.get(image_key)), None
        if jpeg is None or (clip_key and blob is None):  # TTL ran out before a worker came
            await self._finish(entry_id, fields, "expired", "image_gone")
            return
        clip = None
        if blob is not None:
            try:
                clip = split_clip(blob, fields.get("clip_sizes", ""))
            except ValueError as exc:
                await self._finish(entry_id, fields, "dead", "rejected", str(exc))
                return
        media, prompt = await frame_request(self.config, jpeg, fields, clip)
        camera_cfg = self.config.camera(camera)
        schema = camera_cfg.describer.response_schema if camera_cfg is not None else None
        backoff = Backoff(self.d.backoff_initial_s, self.d.backoff_max_s)
        failures = 0
        avoid: frozenset[str] = frozenset()
        error: BaseException | str = "no endpoint in rotation"
        while True:
            left = ts + self.q.max_frame_age_s - time.time()
            if left <= 0:
                await self._finish(entry_id, fields, "expired", "max_age", str(error))
                return
            endpoint = self.pool.pick(avoid)
            if endpoint is None:  # every endpoint out of rotation: wait for one to return
                await self._wait_for_endpoint(min(backoff.next_delay(), left + 0.01))
                continue
            try:
                text, info = await self.pool.describe(endpoint, media, prompt, left, schema)
                break
            except EndpointUnavailable as exc:  # the endpoint's failure: try another at once
                error = exc
            except ServerError as exc:  # the endpoint answered: this frame may be the cause
                failures += 1
                if failures >= self.d.max_failures:
                    detail = f"{failures} server errors, last: {exc}"
                    await self._finish(entry_id, fields, "dead", "server_error", detail)
                    return
                error, avoid = exc, frozenset({endpoint.name})
                left = ts + self.q.max_frame_age_s - time.time()
                await self.sleep(min(backoff.next_delay(), max(left, 0.0) + 0.01))
            except FrameRejected as exc:
                await self._finish(entry_id, fields, "dead", "rejected", str(exc))
                return
        now = time.time()
        result = {
            "frame_id": entry_id,
            "frame_uid": fields.get("frame_uid", ""),
            "camera": camera,
            "ts": fields.get("ts", ""),
            "described_at": f"{now:.6f}",
            "latency_s": f"{now - ts:.3f}",
            "text": text,
            "model": str(info["model"]),
            "completion_tokens": str(info["completion_tokens"]),
            "prompt_tokens": str(info.get("prompt_tokens", 0)),
            "vlm_seconds": f"{info['vlm_seconds']:.3f}",
            "persons": fields.get("persons", "0"),
            "boxes": fields.get("boxes", "[]"),
            "image": image_key,
            "worker": self.consumer,
            "endpoint": str(info.get("endpoint", "")),
        }
        if clip is not None:
            result["clip_frames"] = str(len(clip))
            result["clip_seconds"] = fields.get("clip_seconds", "")
        if schema is not None:
            structured = structured_fields(text)
            if structured is None:  # cut by max_tokens, or an endpoint that ignored the schema
                metrics.STRUCTURED_INVALID.labels(camera).inc()
                log.warning(kv("structured_answer_invalid", camera=camera, frame=entry_id))
            else:
                result["structured"] = structured
        if await self._finish(entry_id, result, "described", "ok", clip_key=clip_key):
            metrics.DESCRIBE_LATENCY.observe(now - ts)

    async def _wait_for_endpoint(self, timeout: float) -> None:
        """Until an endpoint returns to rotation (or a trial falls due), ``timeout`` seconds,
        or a stop request (raises ``Stopping``)."""
        stop = asyncio.ensure_future(self.wait_for_stop())
        change = asyncio.ensure_future(self.pool.wait_for_change(timeout))
        try:
            await asyncio.wait([stop, change], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            change.cancel()
        if self.stopping:
            raise Stopping

    async def _finish(
        self,
        entry_id: str,
        fields: dict[str, str],
        outcome: str,
        reason: str,
        detail: str = "",
        clip_key: str = "",
    ) -> bool:
        """Acknowledge and record atomically; False when another worker already had.
        ``clip_key`` (else ``fields["clip"]``): the clip's key, deleted with the result."""
        camera = fields.get("camera", "?")
        if outcome == "described":
            out_stream, stat, maxlen = (
                self.q.descriptions_stream,
                "described",
                self.q.descriptions_maxlen,
            )
            out = dict(fields)
        else:
            out_stream = (
                self.q.dead_letter_stream if outcome == "dead" else self.q.descriptions_stream
            )
            stat = f"{outcome}:{reason}"
            maxlen = self.q.dead_letter_maxlen
            out = {**fields, "frame_id": entry_id, "reason": reason, "detail": detail[:500]}
        args: list[str] = [self.q.group, entry_id, outcome, stat, str(maxlen)]
        for key, value in out.items():
            args += [key, value]
        keys = [
            self.q.frames_stream,
            out_stream,
            f"{self.q.latest_prefix}{camera}",
            self.q.stats_key,
        ]
        # described frames keep their JPEG until its TTL (an events page may show it); the
        # others free it now. No placeholder key when there is none: an ACL user limited to
        # the queue's key pattern may not touch a key named "".
        image_key = fields.get("image", "")
        if outcome != "described" and image_key:
            keys.append(image_key)
        clip_key = clip_key or fields.get("clip", "")
        if clip_key:  # the snapshot (image) is all an event keeps of a clip
            keys.append(clip_key)
        acked = await self.with_redis(lambda: self._commit_script(keys=keys, args=args))
        if not acked:
            self._count(entry_id, camera, "duplicate", reason)
            return False
        self._count(entry_id, camera, outcome, reason, detail)
        return True

    def _count(
        self, entry_id: str, camera: str, outcome: str, reason: str, detail: str = ""
    ) -> None:
        self.counts[outcome] += 1
        metrics.DESCRIBE_OUTCOMES.labels(camera, outcome, reason).inc()
        level = logging.INFO if outcome == "described" else logging.WARNING
        fields: dict[str, Any] = {"id": entry_id, "camera": camera, "outcome": outcome}
        if reason != "ok":
            fields["reason"] = reason
        if detail:
            fields["detail"] = detail[:200]
        log.log(level, kv("frame_done", consumer=self.consumer, **fields))


def structured_fields(text: str) -> str | None:
    """A structured answer as compact JSON (the event's fields), or None when the text is not
    a JSON object."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    return json.dumps(parsed, separators=(",", ":"), ensure_ascii=False)
