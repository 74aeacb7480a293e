"""Webhooks: each event POSTed as JSON, signed, retried, dead-lettered when refused.

Signature scheme (as Stripe's and GitHub's, so the usual receiver code applies)::

    X-Vision-Serve-Event-Id:  <event_id>             (also in the body; de-duplicate on it)
    X-Vision-Serve-Timestamp: <unix seconds, integer> (a fresh one on every attempt)
    X-Vision-Serve-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>.<event_id>.<raw body>")>

A receiver recomputes the HMAC over the exact bytes it received (before any JSON parsing),
compares in constant time (``hmac.compare_digest``), and refuses timestamps more than a few
minutes old, which makes a captured request useless for a replay later. ``verify()`` below
does all three.

Retries: connection errors, timeouts, 408, 429 and 5xx are tried again with exponential
backoff (``Retry-After`` honoured, up to ``notify.backoff_max_s``), ``max_attempts`` in all.
Any other non-2xx answer (400, 401, 404, a redirect...) will not change by asking again: the
event is dead-lettered at once with the status as the reason's detail. The URL is never
logged or stored (it may carry a token); the sink's name stands for it.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from email.utils import parsedate_to_datetime

import httpx

from pipelines.backoff import Backoff
from pipelines.notify.config import WebhookConfig
from pipelines.notify.event import Event
from pipelines.notify.sink import Dead, Delivered, Hooks, Result

SIGNATURE_HEADER = "X-Vision-Serve-Signature"
EVENT_ID_HEADER = "X-Vision-Serve-Event-Id"
TIMESTAMP_HEADER = "X-Vision-Serve-Timestamp"
ATTEMPT_HEADER = "X-Vision-Serve-Attempt"  # informational, not signed
USER_AGENT = "vision-serve-notify/1"
RETRY_STATUSES = frozenset({408, 429})


def signed_material(timestamp: str, event_id: str, body: bytes) -> bytes:
    return f"{timestamp}.{event_id}.".encode() + body


def sign(secret: str, timestamp: str, event_id: str, body: bytes) -> str:
    """The ``X-Vision-Serve-Signature`` value for these bytes."""
    digest = hmac.new(secret.encode(), signed_material(timestamp, event_id, body), hashlib.sha256)
    return "sha256=" + digest.hexdigest()


def verify(
    secret: str,
    body: bytes,
    signature: str | None,
    timestamp: str | None,
    event_id: str | None,
    tolerance_s: float = 300.0,
    now: float | None = None,
) -> bool:
    """A receiver's check: the signature matches and the timestamp is recent."""
    if not signature or not timestamp or event_id is None:
        return False
    try:
        age = abs((time.time() if now is None else now) - int(timestamp))
    except ValueError:
        return False
    expected = sign(secret, timestamp, event_id, body)
    return hmac.compare_digest(expected, signature) and age <= tolerance_s


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _one_line(text: str, limit: int = 200) -> str:
    return " ".join(text.split())[:limit]


class WebhookSink:
    """POSTs events to one URL."""

    def __init__(
        self,
        cfg: WebhookConfig,
        secret: str,
        hooks: Hooks,
        backoff_initial_s: float,
        backoff_max_s: float,
        concurrency: int,
    ) -> None:
        self.cfg = cfg
        self.name = f"webhook:{cfg.sink_name}"
        self._secret = secret
        self.hooks = hooks
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.http = httpx.AsyncClient(
            follow_redirects=False,
            timeout=cfg.timeout_s,
            limits=httpx.Limits(max_connections=concurrency),
            headers={"User-Agent": USER_AGENT},
        )

    def __repr__(self) -> str:  # never the URL or the secret
        return f"WebhookSink({self.name})"

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        await self.http.aclose()

    def headers(self, event: Event, attempt: int, now: float | None = None) -> dict[str, str]:
        timestamp = str(int(time.time() if now is None else now))
        return {
            "Content-Type": "application/json",
            EVENT_ID_HEADER: event.event_id,
            TIMESTAMP_HEADER: timestamp,
            SIGNATURE_HEADER: sign(self._secret, timestamp, event.event_id, event.body),
            ATTEMPT_HEADER: str(attempt),
        }

    async def deliver(self, event: Event) -> Result:
        backoff = Backoff(self.backoff_initial_s, self.backoff_max_s)
        attempt = 0
        while True:
            attempt += 1
            retry_after = None
            try:
                response = await self.http.post(
                    self.cfg.url, content=event.body, headers=self.headers(event, attempt)
                )
            except httpx.TimeoutException:
                reason, detail = "timeout", f"no answer within {self.cfg.timeout_s:g} s"
            except httpx.TransportError as exc:  # refused, reset, DNS, TLS...
                reason, detail = "connection", self._scrub(f"{type(exc).__name__}: {exc}")
            else:
                status = response.status_code
                if 200 <= status < 300:
                    return Delivered(attempt)
                detail = f"HTTP {status}"
                if response.text:
                    detail += f": {_one_line(response.text)}"
                if status < 500 and status not in RETRY_STATUSES:
                    return Dead("rejected", detail, attempt)
                reason, retry_after = f"http_{status}", _retry_after(response)
            if attempt >= self.cfg.max_attempts:
                return Dead("max_attempts", f"{attempt} attempts, last: {detail}", attempt)
            self.hooks.retry(self.name, reason)
            delay = backoff.next_delay()
            if retry_after is not None:
                delay = min(max(delay, retry_after), self.backoff_max_s)
            await self.hooks.sleep(delay)

    def _scrub(self, text: str) -> str:
        """httpx may name the URL in an error; it may carry a token."""
        return text.replace(self.cfg.url, f"<{self.name}>")
