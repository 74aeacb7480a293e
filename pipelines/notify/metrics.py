"""Prometheus series of ``vision-serve notify`` (served on ``notify.metrics_port``).

Each sink's outcomes are counted per sink -- delivered, retried, dead-lettered, skipped --
here for this process and in the ``notify.stats_key`` Redis hash for the whole deployment
(``delivered:<sink>``, ``retries:<sink>``, ``dead:<sink>:<reason>``,
``skipped:<sink>:<reason>``), so "why did Home Assistant not hear about it?" has an answer.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from pipelines.metrics import LATENCY_BUCKETS

DELIVERED = Counter("vs_notify_delivered", "events a sink has (acknowledged by it)", ["sink"])
RETRIES = Counter(
    "vs_notify_retries", "failed attempts that will be tried again", ["sink", "reason"]
)
DEAD = Counter("vs_notify_dead", "events given up on, to the dead letters", ["sink", "reason"])
SKIPPED = Counter(
    "vs_notify_skipped", "stream entries that are no event (expired...), acked", ["sink", "reason"]
)
SINK_UP = Gauge("vs_notify_sink_up", "0 while the sink's last attempt failed", ["sink"])
PENDING = Gauge("vs_notify_pending_entries", "read by the sink, not yet acknowledged", ["sink"])
LAG = Gauge("vs_notify_lag_entries", "descriptions the sink has not read yet", ["sink"])
INFLIGHT = Gauge("vs_notify_inflight", "events being delivered by this process", ["sink"])
LATENCY = Histogram(
    "vs_notify_latency_seconds",
    "description stored -> the sink has it",
    ["sink"],
    buckets=LATENCY_BUCKETS,
)
REDIS_ERRORS = Counter("vs_notify_redis_errors", "Redis connection failures")
