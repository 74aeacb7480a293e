"""Engine counters, readable at any time (snapshots, not live objects)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass
class ClassStats:
    """Per priority class (interactive / batch): where its latency went, what it lost."""

    finished: int = 0
    expired: int = 0
    aborted: int = 0
    preemptions: int = 0
    queue_time_s_total: float = 0.0  # arrival -> first chunk scheduled
    ttft_s_total: float = 0.0
    ttft_count: int = 0
    itl_s_total: float = 0.0
    itl_count: int = 0
    itl_max_s: float = 0.0

    @property
    def mean_ttft_s(self) -> float:
        return self.ttft_s_total / self.ttft_count if self.ttft_count else 0.0

    @property
    def mean_itl_s(self) -> float:
        return self.itl_s_total / self.itl_count if self.itl_count else 0.0


STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
STEP_SECONDS_BUCKETS = (0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    num_expired: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found (not recomputed)
    num_steps: int = 0
    # steps given up for an arriving chat request (engine/step_interrupt.py)
    num_interrupted_steps: int = 0
    last_step_time_s: float = 0.0
    max_step_time_s: float = 0.0  # the longest step so far: the worst stall any stream saw
    last_step_prefill_tokens: int = 0
    last_step_decode_tokens: int = 0
    last_step_encoder_s: float = 0.0
    total_prompt_tokens: int = 0
    total_generation_tokens: int = 0
    total_prefill_tokens_computed: int = 0
    total_step_time_s: float = 0.0
    cost_model: dict[str, float] = field(default_factory=dict)  # learnt step-time coefficients
    itl_target_s: float | None = None  # target applied to the last step (None: full budget)
    prefill_budget: int = 0  # prefill tokens the last step allowed
    per_class: dict[str, ClassStats] = field(default_factory=dict)
    # tokens per step as a cumulative histogram (Prometheus style): bucket bound -> steps <= it
    step_tokens_buckets: dict[int, int] = field(
        default_factory=lambda: dict.fromkeys(STEP_TOKEN_BUCKETS, 0)
    )
    step_tokens_sum: int = 0
    step_seconds_buckets: dict[float, int] = field(
        default_factory=lambda: dict.fromkeys(STEP_SECONDS_BUCKETS, 0)
    )

    def record_step_time(self, seconds: float) -> None:
        self.max_step_time_s = max(self.max_step_time_s, seconds)
        for bound in STEP_SECONDS_BUCKETS:
            if seconds <= bound:
                self.step_seconds_buckets[bound] += 1

    def record_step_tokens(self, tokens: int) -> None:
        self.step_tokens_sum += tokens
        for bound in STEP_TOKEN_BUCKETS:
            if tokens <= bound:
                self.step_tokens_buckets[bound] += 1

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def record_finished(self, req) -> None:
        cls = self.per_class.setdefault(req.priority.name.lower(), ClassStats())
        m = req.metrics
        status = req.status.value
        if status == "expired":
            cls.expired += 1
        elif status == "abort":
            cls.aborted += 1
        else:
            cls.finished += 1
        cls.preemptions += m.num_preemptions
        if m.first_scheduled_time is not None:
            cls.queue_time_s_total += m.first_scheduled_time - m.arrival_time
        if m.first_token_time is not None:
            cls.ttft_s_total += m.first_token_time - m.arrival_time
            cls.ttft_count += 1
        cls.itl_s_total += m.itl_total_s
        cls.itl_count += m.num_itl
        cls.itl_max_s = max(cls.itl_max_s, m.itl_max_s)

    def snapshot(self) -> EngineStats:
        return copy.deepcopy(self)
