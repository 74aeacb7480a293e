"""What the long-running workers share: how they are asked to stop, and how they ride out Redis.

``RedisWorker`` is the base of the describer and the notifier (asyncio): a stop request that a
signal handler or another thread may make, sleeps that end as soon as it is made (raising
``Stopping`` in the task that slept), and Redis calls retried with backoff while Redis is
unreachable, so that a Redis restart costs a pause, never the process.

``ThreadWorker`` is the base of the ui's event consumer and retention loop: ``_run`` on a
daemon thread until ``stop()`` sets ``_stop``.

Kept light: no cv2 (``pipelines.queue`` brings it; the notifier does not need it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

import redis
import redis.asyncio as aredis

from pipelines.backoff import Backoff
from pipelines.logs import kv
from pipelines.redis_urls import make_client

log = logging.getLogger(__name__)

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)
T = TypeVar("T")


class Stopping(Exception):
    """Raised inside a worker's task when it is asked to stop before the work is done."""


def log_redis_down(component: str, exc: BaseException) -> None:
    """One log line for an unusable Redis. A refused login is a ``ConnectionError`` too and
    is retried like an outage (the password may be fixed on the server side), but it is
    named as what it is, at error level, so it is not mistaken for a network blip."""
    if isinstance(exc, redis.AuthenticationError):
        log.error(kv("redis_auth_failed", component=component, error=exc))
    else:
        log.warning(kv("redis_unavailable", component=component, error=exc))


def connect_async(url: str, block_ms: int) -> aredis.Redis:
    """An asyncio client whose reads outlive an ``XREADGROUP BLOCK`` but not a dead server
    (any URL form ``queue.connect`` takes: the two share ``redis_urls.make_client``)."""
    return make_client(
        url,
        asyncio=True,
        socket_timeout=block_ms / 1000 + 5.0,
        socket_connect_timeout=2.0,
        health_check_interval=15,
    )


async def renew_claims(
    client: aredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    inflight: dict[str, Any],
    claim_idle_s: float,
    **log_fields: Any,
) -> None:
    """Until cancelled: renew the claim on the entries in ``inflight`` (``XCLAIM ... JUSTID``
    resets their idle time without counting a delivery) every third of ``claim_idle_s``, so a
    live worker's entries never look abandoned, however long it works on them."""
    period = max(0.1, min(claim_idle_s / 3, 5.0))
    while True:
        await asyncio.sleep(period)
        ids = list(inflight)
        if not ids:
            continue
        try:
            await client.xclaim(stream, group, consumer, 0, ids, justid=True)
        except (redis.RedisError, OSError) as exc:
            log.debug(kv("heartbeat_failed", **log_fields, error=exc))


class RedisWorker:
    """A worker whose ``run()`` loops until ``request_stop()``.

    ``component`` names it in log lines; ``redis_errors`` (a Prometheus counter, or one of its
    children) counts each failed Redis call; the backoff bounds pace the retries.
    """

    def __init__(
        self, component: str, redis_errors: Any, backoff_initial_s: float, backoff_max_s: float
    ) -> None:
        self.component = component
        self._redis_errors = redis_errors
        self._backoff_s = (backoff_initial_s, backoff_max_s)
        self._stop = asyncio.Event()  # binds to the loop that first waits on it
        self._loop: asyncio.AbstractEventLoop | None = None

    def _started(self) -> None:
        """Call first thing in ``run()``: stop requests from other threads go to this loop."""
        self._loop = asyncio.get_running_loop()

    def request_stop(self) -> None:
        """Stop taking work; safe to call from a signal handler or another thread."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._loop is not None and running is not self._loop:
            self._loop.call_soon_threadsafe(self._stop.set)
        else:
            self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def wait_for_stop(self) -> None:
        await self._stop.wait()

    async def sleep(self, seconds: float) -> None:
        """Sleep, but raise ``Stopping`` as soon as the worker is asked to stop."""
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=max(0.0, seconds))
        except TimeoutError:
            return
        raise Stopping

    async def with_redis(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a Redis call, retrying with backoff while Redis is unreachable."""
        backoff = Backoff(*self._backoff_s)
        while True:
            try:
                return await call()
            except REDIS_DOWN as exc:
                await self.redis_down(exc, backoff)

    async def redis_down(self, exc: BaseException, backoff: Backoff) -> None:
        """Count a failed Redis call, log the first of a run of them, and wait the backoff."""
        self._redis_errors.inc()
        if backoff.attempts == 0:
            log_redis_down(self.component, exc)
        await self.sleep(backoff.next_delay())


class ThreadWorker:
    """``_run`` on its own daemon thread; it returns once ``stop()`` has set ``_stop``."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
