"""Several OpenAI-compatible endpoints for one describer: pick, take out, put back.

Why: one engine box is a single point of failure and a ceiling; a describer given
``describer.endpoints`` (ours, vLLM, llama.cpp's ``llama-server``...) spreads frames over
them and rides out the loss of one.

- **Balance by queue depth.** Each endpoint's ``/metrics`` is read every
  ``probe_interval_s``: waiting + running requests (``vision_serve_num_requests_*``,
  ``vllm:num_requests_*``, ``llamacpp:requests_processing`` / ``_deferred``) -- the load from
  every client, not only this worker. Requests sent since that read are added on top. An
  endpoint without such metrics is loaded by this worker's requests in flight to it. Ties go
  to the endpoint picked least recently, so idle endpoints share the work.
- **Out of rotation** when its ``/health`` fails (connection refused, timeout, 5xx), when a
  request fails as an outage (``vlm.EndpointUnavailable``: refused, timeout, 429, 502-504...)
  or after ``down_after_errors`` server errors (HTTP 500...) in a row. The frame that was on
  it is simply sent elsewhere (``describe.py``): an endpoint's death is not the frame's
  failure.
- **Back in rotation** when a background probe of ``/health`` answers 200; the probes of a
  down endpoint back off (``backoff_initial_s`` doubling up to ``backoff_max_s``), and the
  backoff restarts only after a request succeeds, so a server whose ``/health`` says yes while
  its requests fail is retried ever more slowly instead of flapping. An endpoint that has no
  ``/health`` (404 / 405 / 501, or ``health_url: ""``) cannot be judged by a probe: once its
  backoff has passed one frame is sent to it as a trial, and its answer decides.

State changes are logged (``endpoint_down`` / ``endpoint_up``) and exported per endpoint
(``pipelines.metrics``: ``vs_vlm_endpoint_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Any

import httpx

from pipelines import metrics
from pipelines.backoff import Backoff
from pipelines.config import DescriberConfig, EndpointConfig
from pipelines.logs import kv
from pipelines.vlm import ClipMedia, EndpointUnavailable, FrameRejected, ServerError, VLMClient

log = logging.getLogger(__name__)

# gauges whose sum is an endpoint's queue depth, by server
DEPTH_METRICS = (
    "vision_serve_num_requests_waiting",
    "vision_serve_num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
)
_DEPTH_LINE = re.compile(
    r"^(" + "|".join(re.escape(m) for m in DEPTH_METRICS) + r")(\{[^}]*\})?\s+(\S+)", re.M
)
# /health answers that mean "no such route", not "unhealthy"
NO_ROUTE = {404, 405, 501}


def queue_depth(text: str) -> float | None:
    """Waiting + running requests in a Prometheus text page; None when it has neither."""
    found = False
    total = 0.0
    for match in _DEPTH_LINE.finditer(text):
        try:
            total += float(match.group(3))
        except ValueError:
            continue
        found = True
    return total if found else None


class Endpoint:
    """One endpoint as this worker sees it: in rotation or not, its load, its client."""

    def __init__(self, cfg: EndpointConfig, describer: DescriberConfig) -> None:
        self.cfg = cfg
        self.name = cfg.label
        self.client = VLMClient(describer, cfg)
        self.up = True  # until a request or a probe says otherwise
        self.health_route: bool | None = None if cfg.health else False
        self.metrics_route = bool(cfg.metrics)
        self.depth: float | None = None  # waiting + running at the last /metrics read
        self.sent_since_read = 0
        self.inflight = 0
        self.errors_in_row = 0
        self.backoff = Backoff(describer.backoff_initial_s, describer.backoff_max_s)
        self.retry_at = 0.0  # monotonic: when a down endpoint is probed / tried next
        self.trial_open = False  # a trial request is on its way (no-health endpoints)
        self.last_picked = 0.0
        metrics.ENDPOINT_UP.labels(self.name).set(1)
        metrics.ENDPOINT_INFLIGHT.labels(self.name).set(0)

    @property
    def load(self) -> float:
        """Requests ahead of a new one: the reported depth plus what was sent since, else the
        requests this worker has open there."""
        if self.depth is None:
            return float(self.inflight)
        return self.depth + self.sent_since_read

    @property
    def trial_due(self) -> bool:
        """A down endpoint no probe can judge, whose backoff has passed: one frame may try."""
        return (
            not self.up
            and self.health_route is not True
            and not self.trial_open
            and time.monotonic() >= self.retry_at
        )


class EndpointPool:
    """The describer's endpoints; ``run()`` probes them until cancelled."""

    def __init__(self, cfg: DescriberConfig) -> None:
        self.cfg = cfg
        self.endpoints = [Endpoint(e, cfg) for e in cfg.endpoint_list()]
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._http = httpx.AsyncClient(timeout=min(5.0, cfg.timeout_s), follow_redirects=True)
        metrics.VLM_UP.set(1)

    # -- choosing ---------------------------------------------------------------------------
    @property
    def any_up(self) -> bool:
        return any(ep.up for ep in self.endpoints)

    def pick(self, avoid: frozenset[str] = frozenset()) -> Endpoint | None:
        """The least loaded endpoint in rotation (one in ``avoid`` only when no other is),
        else one due a trial; None when every endpoint is out and none may be tried yet."""
        up = [ep for ep in self.endpoints if ep.up]
        preferred = [ep for ep in up if ep.name not in avoid] or up
        # a trial: any due one when nothing is up; else only those no probe can judge
        trials = [ep for ep in self.endpoints if ep.trial_due]
        if up:
            trials = [ep for ep in trials if ep.health_route is False]
        if trials:
            ep = min(trials, key=lambda e: e.retry_at)
            ep.trial_open = True
        elif preferred:
            ep = min(preferred, key=lambda e: (e.load, e.inflight, e.last_picked))
        else:
            return None
        ep.last_picked = time.monotonic()
        return ep

    async def wait_for_change(self, timeout: float) -> None:
        """Until an endpoint changes state, a trial falls due, or ``timeout`` seconds."""
        changed = self._changed
        due = [ep.retry_at for ep in self.endpoints if not ep.up and ep.health_route is not True]
        if due:
            timeout = min(timeout, max(0.0, min(due) - time.monotonic()) + 0.001)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout=max(0.0, timeout))

    # -- one request ------------------------------------------------------------------------
    async def describe(
        self,
        ep: Endpoint,
        media: bytes | ClipMedia,
        prompt: str,
        deadline_s: float | None,
        response_schema: dict[str, Any] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """``ep.client.describe`` with the endpoint's accounts kept: in flight, outcome, and
        its state (an outage takes it out; an answer after an outage puts it back)."""
        ep.inflight += 1
        ep.sent_since_read += 1
        metrics.ENDPOINT_INFLIGHT.labels(ep.name).set(ep.inflight)
        try:
            text, info = await ep.client.describe(media, prompt, deadline_s, response_schema)
        except EndpointUnavailable as exc:
            self._outcome(ep, "unavailable")
            self._down(ep, "request", exc)
            raise
        except ServerError as exc:
            self._outcome(ep, "server_error")
            ep.errors_in_row += 1
            if not ep.up or ep.errors_in_row >= self.cfg.down_after_errors:
                self._down(ep, "server_errors", exc)
            raise
        except FrameRejected:
            self._outcome(ep, "rejected")
            self._answered(ep)
            raise
        finally:
            ep.inflight -= 1
            ep.trial_open = False
            metrics.ENDPOINT_INFLIGHT.labels(ep.name).set(ep.inflight)
        self._outcome(ep, "ok")
        self._answered(ep)
        ep.backoff.reset()
        info["endpoint"] = ep.name
        return text, info

    async def describe_now(
        self,
        media: bytes | ClipMedia,
        prompt: str,
        response_schema: dict[str, Any] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """One answer for a caller that cannot wait for an endpoint to come back (a person
        pressing "describe again"): each endpoint in rotation (or due a trial) is tried at
        most once, least loaded first, and one that is down moves the request on at once.

        Raises ``FrameRejected`` at once (the request's fault, not the endpoint's), the last
        ``ServerError`` when some endpoint answered with one, else ``EndpointUnavailable``
        (every endpoint refused, timed out, or is out of rotation)."""
        tried: set[str] = set()
        server_error: ServerError | None = None
        unavailable = EndpointUnavailable("no endpoint in rotation")
        while (ep := self.pick(frozenset(tried))) is not None:
            if ep.name in tried:  # pick offers an avoided one only when nothing else is left
                ep.trial_open = False
                break
            tried.add(ep.name)
            try:
                return await self.describe(ep, media, prompt, None, response_schema)
            except EndpointUnavailable as exc:
                unavailable = exc
            except ServerError as exc:
                server_error = exc
        raise server_error or unavailable

    def _outcome(self, ep: Endpoint, outcome: str) -> None:
        metrics.ENDPOINT_REQUESTS.labels(ep.name, outcome).inc()

    def _answered(self, ep: Endpoint) -> None:
        ep.errors_in_row = 0
        if not ep.up:
            self._up(ep, "request")

    # -- state changes ----------------------------------------------------------------------
    def _down(self, ep: Endpoint, why: str, error: Any) -> None:
        ep.retry_at = time.monotonic() + ep.backoff.next_delay()
        if not ep.up:
            return
        ep.up = False
        ep.depth = None
        log.warning(kv("endpoint_down", endpoint=ep.name, why=why, error=error))
        self._changed_state(ep, "down")

    def _up(self, ep: Endpoint, why: str) -> None:
        ep.up = True
        ep.errors_in_row = 0
        log.info(kv("endpoint_up", endpoint=ep.name, why=why))
        self._changed_state(ep, "up")

    def _changed_state(self, ep: Endpoint, to: str) -> None:
        metrics.ENDPOINT_UP.labels(ep.name).set(1 if ep.up else 0)
        metrics.ENDPOINT_TRANSITIONS.labels(ep.name, to).inc()
        metrics.VLM_UP.set(1 if self.any_up else 0)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()  # wakes every waiter of the old event
        self._wake.set()

    # -- probing ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Until cancelled: check endpoints in rotation every ``probe_interval_s`` (health,
        queue depth), and probe those out of rotation when their backoff has passed."""
        next_check = {ep.name: 0.0 for ep in self.endpoints}

        def when(ep: Endpoint) -> float | None:
            if ep.up:
                return next_check[ep.name]
            return ep.retry_at if ep.health_route is not False else None  # None: trials

        while True:
            now = time.monotonic()
            due = [ep for ep in self.endpoints if (t := when(ep)) is not None and now >= t]
            for ep in due:
                next_check[ep.name] = now + self.cfg.probe_interval_s
            if due:
                await asyncio.gather(*(self._probe(ep) for ep in due))
            times = [t for ep in self.endpoints if (t := when(ep)) is not None]
            wait = min(times, default=time.monotonic() + self.cfg.probe_interval_s)
            wait -= time.monotonic()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.01, wait))

    async def _probe(self, ep: Endpoint) -> None:
        healthy = await self._health(ep)
        if ep.up:
            if healthy is False:
                self._down(ep, "health_check", "health check failed")
            elif ep.metrics_route:
                await self._read_depth(ep)
        elif healthy is True:
            self._up(ep, "health_check")
            await self._read_depth(ep)
        elif healthy is False:  # still failing: probe again after the next delay
            ep.retry_at = time.monotonic() + ep.backoff.next_delay()
        # None: no /health to ask; a trial request decides (``pick``)

    async def _health(self, ep: Endpoint) -> bool | None:
        """True: 200. False: unreachable or 5xx. None: no ``/health`` to ask."""
        if ep.health_route is False:
            return None
        try:
            response = await self._http.get(ep.cfg.health)
        except httpx.HTTPError:
            return False
        if response.status_code in NO_ROUTE:
            ep.health_route = False
            log.info(kv("endpoint_no_health_route", endpoint=ep.name, url=ep.cfg.health))
            return None
        ep.health_route = True
        return response.status_code == 200

    async def _read_depth(self, ep: Endpoint) -> None:
        if not ep.metrics_route:
            return
        try:
            response = await self._http.get(ep.cfg.metrics)
        except httpx.HTTPError:
            ep.depth = None
            return
        if response.status_code in NO_ROUTE:
            ep.metrics_route = False  # balanced by in-flight count from now on
            return
        depth = queue_depth(response.text) if response.status_code == 200 else None
        ep.depth, ep.sent_since_read = depth, 0
        if depth is not None:
            metrics.ENDPOINT_QUEUE.labels(ep.name).set(depth)

    async def close(self) -> None:
        await self._http.aclose()
        for ep in self.endpoints:
            await ep.client.close()
