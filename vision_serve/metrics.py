"""Per-request accounting: Prometheus series and the one structured log line per request.

TTFT is split where it is spent, so a slow first token can be blamed: ``queue`` (arrival at the
engine -> first chunk scheduled), ``prefill`` (first chunk scheduled -> last chunk done, with the
number of chunks) and ``decode`` (first token -> finished). TTFT and E2E themselves are measured
at the server (arrival of the HTTP request -> first token handed to the client), as DESIGN.md
defines them. Every series is labelled by priority class, because the whole point of the engine
is that the two classes see different latencies.

Engine-wide state (running/waiting, KV usage, cache hits, preemptions, steps) is read from
``engine.get_stats()`` at scrape time by a custom collector, so nothing polls the engine.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

request_logger = logging.getLogger("vision_serve.requests")

PREFIX = "vision_serve"
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_CHUNK_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class _StatsSource(Protocol):
    def get_stats(self) -> Any: ...


@dataclass
class RequestRecord:
    """Everything the request log line and the histograms need about one finished request."""

    id: str  # the engine's id (ours, unique); the response id is built from it
    endpoint: str
    priority: str
    stream: bool
    client_request_id: str | None = None  # the client's x-request-id, echoed, never used as a key
    status: int = 200
    finish_reason: str | None = None
    prompt_tokens: int = 0
    image_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    prefill_chunks: int = 0
    decode_s: float | None = None
    preemptions: int = 0
    error_code: str | None = None
    user: str | None = None
    itl_s: list[float] = field(default_factory=list, repr=False)
    # The engine's own timestamps (monotonic), kept for in-process inspection (tests, debugging
    # tools reading ``app.state.metrics.recent``); not logged.
    engine_metrics: Any = field(default=None, repr=False)

    @property
    def header_id(self) -> str:
        """The ``x-request-id`` response header: the client's own id if it sent one."""
        return self.client_request_id or self.id

    def log_fields(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k not in ("itl_s", "engine_metrics")}
        if self.itl_s:
            out["max_itl_s"] = max(self.itl_s)
        return {
            k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items() if v is not None
        }


def fill_engine_timings(record: RequestRecord, metrics: Any) -> None:
    """Copy queue/prefill/decode durations from the engine's ``RequestMetrics``."""
    if metrics is None:
        return
    record.engine_metrics = metrics
    arrival = metrics.arrival_time
    scheduled = metrics.first_scheduled_time
    prefill_done = metrics.prefill_done_time
    first_token = metrics.first_token_time
    finished = metrics.finished_time
    if scheduled is not None:
        record.queue_s = max(0.0, scheduled - arrival)
        if prefill_done is not None:
            record.prefill_s = max(0.0, prefill_done - scheduled)
    if first_token is not None and finished is not None:
        record.decode_s = max(0.0, finished - first_token)
    record.prefill_chunks = int(metrics.num_prefill_chunks or 0)
    record.preemptions = int(getattr(metrics, "num_preemptions", 0) or 0)


class ServerMetrics:
    """Owns one registry (one per app, so tests can run several apps in one process)."""

    def __init__(self, engine: _StatsSource, recent: int = 1024) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.recent: deque[RequestRecord] = deque(maxlen=recent)
        labels = ["priority"]

        def hist(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(
                f"{PREFIX}_{name}", doc, labels, buckets=buckets, registry=self.registry
            )

        self.ttft = hist("time_to_first_token_seconds", "HTTP arrival -> first token sent.")
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive token outputs.")
        self.e2e = hist("e2e_request_latency_seconds", "HTTP arrival -> last token sent.")
        self.queue = hist("request_queue_time_seconds", "Engine arrival -> first scheduled.")
        self.prefill = hist(
            "request_prefill_time_seconds", "First prefill chunk scheduled -> last chunk done."
        )
        self.decode = hist("request_decode_time_seconds", "First token -> request finished.")
        self.chunks = hist(
            "request_prefill_chunks", "Prefill chunks per request.", buckets=_CHUNK_BUCKETS
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Finished requests by outcome.",
            ["priority", "finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens",
            "Prompt tokens (incl. image).",
            labels,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated tokens.", labels, registry=self.registry
        )
        self.registry.register(EngineStatsCollector(engine))

    def observe(self, record: RequestRecord) -> None:
        """Record one finished request in the histograms, the recent list and the log."""
        p = record.priority
        if record.ttft_s is not None:
            self.ttft.labels(p).observe(record.ttft_s)
        if record.e2e_s is not None and record.status == 200:
            self.e2e.labels(p).observe(record.e2e_s)
        for gap in record.itl_s:
            self.itl.labels(p).observe(gap)
        if record.queue_s is not None:
            self.queue.labels(p).observe(record.queue_s)
        if record.prefill_s is not None:
            self.prefill.labels(p).observe(record.prefill_s)
            self.chunks.labels(p).observe(record.prefill_chunks)
        if record.decode_s is not None:
            self.decode.labels(p).observe(record.decode_s)
        outcome = record.finish_reason or record.error_code or "error"
        self.requests.labels(p, outcome).inc()
        self.prompt_tokens.labels(p).inc(record.prompt_tokens)
        self.generation_tokens.labels(p).inc(record.output_tokens)
        self.recent.append(record)

    @staticmethod
    def log(record: RequestRecord) -> None:
        request_logger.info(json.dumps({"event": "request", **record.log_fields()}))


# (kind, exported name, engine stats attribute, help). Counters are cumulative engine totals;
# tokens per step = rate(step_*_tokens_total) / rate(engine_steps_total). Attributes an engine
# version does not have are skipped, so the collector survives the stats object growing.
_ENGINE_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("gauge", "num_requests_running", "num_running", "Requests in the running batch."),
    ("gauge", "num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("gauge", "kv_cache_blocks_total", "kv_blocks_total", "KV cache blocks."),
    ("gauge", "kv_cache_blocks_used", "kv_blocks_used", "KV cache blocks in use."),
    ("counter", "prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up."),
    ("counter", "prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found cached."),
    ("counter", "encoder_cache_hits", "encoder_cache_hits", "Images found encoded."),
    ("counter", "encoder_cache_misses", "encoder_cache_misses", "Images encoded."),
    ("counter", "num_preemptions", "num_preemptions", "Preemptions (KV recomputed)."),
    ("counter", "requests_aborted", "num_aborted", "Requests aborted (e.g. client gone)."),
    ("counter", "requests_expired", "num_expired", "Batch requests expired before prefill."),
    ("counter", "engine_steps", "num_steps", "Engine steps (forward passes)."),
    ("counter", "engine_step_seconds", "total_step_time_s", "Time spent in engine steps."),
    ("counter", "step_prompt_tokens", "total_prefill_tokens_computed", "Prefill tokens computed."),
    ("counter", "step_generation_tokens", "total_generation_tokens", "Tokens generated."),
    ("gauge", "last_step_prefill_tokens", "last_step_prefill_tokens", "Prefill tokens, last step."),
    ("gauge", "last_step_decode_tokens", "last_step_decode_tokens", "Decode tokens, last step."),
    ("gauge", "last_step_time_seconds", "last_step_time_s", "Duration of the last step."),
    ("gauge", "max_step_time_seconds", "max_step_time_s", "Longest step since start."),
    ("gauge", "last_step_encoder_seconds", "last_step_encoder_s", "Vision encoder, last step."),
)


class EngineStatsCollector(Collector):
    """Exposes ``engine.get_stats()`` at scrape time (gauges for state, counters for totals)."""

    def __init__(self, engine: _StatsSource) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        try:
            stats = self.engine.get_stats()
        except Exception:  # a dead engine must not break /metrics; /health reports it
            return
        for kind, name, attr, doc in _ENGINE_SERIES:
            value = getattr(stats, attr, None)
            if value is None:
                continue
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(f"{PREFIX}_{name}", doc, value=float(value))
        yield from _policy_series(stats)
        total = getattr(stats, "kv_blocks_total", 0) or 0
        used = getattr(stats, "kv_blocks_used", 0) or 0
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_usage_perc",
            "Fraction of KV blocks in use.",
            value=used / total if total else 0.0,
        )


def _policy_series(stats: Any) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Per-class outcomes, the step-cost model and the budget it chose, tokens per step."""
    per_class = getattr(stats, "per_class", None) or {}
    for name, attr, doc in (
        ("class_requests_finished", "finished", "Requests finished, per priority class."),
        ("class_requests_expired", "expired", "Requests expired, per priority class."),
        ("class_requests_aborted", "aborted", "Requests aborted, per priority class."),
        ("class_preemptions", "preemptions", "Preemptions, per priority class."),
        ("class_queue_seconds", "queue_time_s_total", "Queue time, per priority class."),
    ):
        family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["priority"])
        for cls, cls_stats in per_class.items():
            family.add_metric([cls], float(getattr(cls_stats, attr, 0)))
        yield family
    coefficients = getattr(stats, "cost_model", None) or {}
    family = GaugeMetricFamily(
        f"{PREFIX}_step_cost_coefficient", "Learnt step-time model (s per unit).", labels=["term"]
    )
    for term, value in coefficients.items():
        family.add_metric([term], float(value))
    yield family
    target = getattr(stats, "itl_target_s", None)
    yield GaugeMetricFamily(
        f"{PREFIX}_itl_target_seconds",
        "ITL target applied to the last step (0: none, full budget).",
        value=float(target or 0.0),
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_prefill_budget_tokens",
        "Prefill tokens the last step allowed.",
        value=float(getattr(stats, "prefill_budget", 0)),
    )
    steps = float(getattr(stats, "num_steps", 0))
    for name, doc, buckets_attr, sum_attr in (
        (
            "step_seconds",
            "Duration of engine steps (a chat stream's ITL is at least its step's).",
            "step_seconds_buckets",
            "total_step_time_s",
        ),
        (
            "step_tokens",
            "Tokens (prefill + decode) per engine step.",
            "step_tokens_buckets",
            "step_tokens_sum",
        ),
    ):
        buckets = getattr(stats, buckets_attr, None)
        if buckets:
            pairs = [(str(b), float(c)) for b, c in sorted(buckets.items())] + [("+Inf", steps)]
            yield HistogramMetricFamily(
                f"{PREFIX}_{name}",
                doc,
                buckets=pairs,
                sum_value=float(getattr(stats, sum_attr, 0)),
            )
