"""Per-request sampling parameters, named as vLLM names them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutputsParams

# ``torch.Generator.manual_seed`` takes [-2**63, 2**64 - 1] and raises outside it; we accept the
# signed 64-bit range (as vLLM's protocol does) so every seed means one generator state, and an
# out-of-range seed is a 400 at the door instead of an exception on the engine's step thread.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
# Stop strings are searched for in the output every step and their longest length minus one is
# held back from streaming clients, so their length is bounded.
MAX_STOP_STRING_CHARS = 256
# vLLM's default ``--max-logprobs``; OpenAI allows 20 for chat ``top_logprobs``.
MAX_LOGPROBS = 20
# OpenAI's bounds for ``logit_bias`` values.
LOGIT_BIAS_LIMIT = 100.0


def _is_int(value: object) -> bool:
    """A real integer: ``bool`` is an ``int`` subclass that ``manual_seed`` refuses."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool): NaN would poison every logit it touches."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``seed`` makes one request reproducible regardless of what
    else shares the batch: each request owns its own generator.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # drop tokens less likely than min_p x the best token's probability
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # penalties, as vLLM applies them: presence/frequency on generated tokens (OpenAI's
    # definition), repetition (CTRL's, > 1 discourages) on prompt and generated tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # None: no logprobs; k >= 0: the sampled token's logprob and the k most likely tokens'
    logprobs: int | None = None
    # constrained decoding (JSON schema, regex, choice): engine/structured_output.py
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Refuse here, on the caller's thread, anything that would raise later on the engine's
        step thread (a bad seed, a non-finite temperature, a non-string stop) and so fail a
        request only after it was queued."""
        for name in ("max_tokens", "top_k", "min_tokens", "seed"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise InvalidRequestError(f"{name} must be an integer", param=name)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidRequestError(
                f"seed must be a signed 64-bit integer, in [{SEED_MIN}, {SEED_MAX}]", param="seed"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature must be a finite number >= 0", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be a number in [0, 1]", param="min_p")
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be -1, 0 (disabled) or positive", param="top_k")
        if self.min_tokens < 0:
            raise InvalidRequestError("min_tokens must be >= 0", param="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens must not exceed max_tokens", param="min_tokens")
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", param="stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequestError(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters", param="stop"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2]", param=name)
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0.0 < rp <= 10.0:
            raise InvalidRequestError(
                "repetition_penalty must be a number in (0, 10]", param="repetition_penalty"
            )
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise InvalidRequestError(
                        f"logit_bias keys must be token ids, got {token!r}", param="logit_bias"
                    )
                if not _is_number(bias) or abs(bias) > LOGIT_BIAS_LIMIT:
                    raise InvalidRequestError(
                        f"logit_bias values must be numbers in [-100, 100], got {bias!r}",
                        param="logit_bias",
                    )
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}]", param="logprobs"
            )
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(
                "stop_token_ids must be non-negative integers", param="stop_token_ids"
            )
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
