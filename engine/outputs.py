"""Results handed back to callers, shaped as vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the model (raw logits, before penalties,
    bias or temperature, as vLLM reports by default), its rank and the best alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class CompletionOutput:
    """One generated sequence. ``text``/``token_ids`` are cumulative; ``delta_*`` are what is new
    since the previous output of the same request (what a streaming server sends)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "expired" | None (running)
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # with ``SamplingParams.logprobs`` set: one entry per token of the delta, and (on the
    # final output only, to spare a copy per step) one per token of ``token_ids``
    logprobs: list[TokenLogprob] | None = None
    delta_logprobs: list[TokenLogprob] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic()`` seconds) of one request's life, for TTFT diagnosis.

    queue time = first_scheduled - arrival; prefill time = prefill_done - first_scheduled;
    decode time = finished - first_token.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    prefill_done_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prefill_chunks: int = 0
    num_preemptions: int = 0
    itl_max_s: float = 0.0  # longest gap between two of its tokens (a stall shows here)
    itl_total_s: float = 0.0
    num_itl: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    num_image_tokens: int = 0
