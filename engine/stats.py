"""Engine counters, readable at any time (a snapshot, not live objects)."""

from __future__ import annotations

from dataclasses import dataclass


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
    prefix_cache_hits: int = 0
    num_steps: int = 0
    last_step_time_s: float = 0.0
    last_step_prefill_tokens: int = 0
    last_step_decode_tokens: int = 0
    last_step_encoder_s: float = 0.0
    total_prompt_tokens: int = 0
    total_generation_tokens: int = 0
    total_prefill_tokens_computed: int = 0
    total_step_time_s: float = 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
