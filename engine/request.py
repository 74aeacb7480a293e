"""A request's plain state, as the scheduler and engine track it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.outputs import RequestMetrics, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; KV freed, will recompute
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_EXPIRED = "expired"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "expired")


class Priority(enum.IntEnum):
    """Lower value is served first."""

    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def parse(cls, value: str | int | Priority | None) -> Priority:
        if value is None:
            return cls.INTERACTIVE
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[str(value).upper()]
        except KeyError:
            from engine.errors import InvalidRequestError

            raise InvalidRequestError(
                f"priority must be 'interactive' or 'batch', got {value!r}", param="priority"
            ) from None


@dataclass
class ImageInput:
    """One image or video clip of a prompt: preprocessed pixels and where its placeholder
    tokens sit. A clip is the same thing with ``grid_thw[0] > 1`` (one temporal patch per two
    frames), so the scheduler's encoder budget and cache treat both alike."""

    content_hash: str  # of the preprocessed pixels: identical frames share encoder-cache entries
    offset: int  # index of the first placeholder token in the prompt
    num_tokens: int  # number of placeholder tokens (= embeddings the tower produces)
    pixel_values: torch.Tensor  # [patches, C*T*P*P]
    grid_thw: tuple[int, int, int]
    kind: str = "image"  # "image" | "video"
    # M-RoPE temporal position step per temporal patch, as a float32 value: 1 for images and
    # Qwen2-VL clips, tokens_per_second * seconds per temporal patch for Qwen2.5-VL clips
    temporal_step: float = 1.0


@dataclass
class ProcessedPrompt:
    """What input processing hands the engine: tokens, M-RoPE positions, images."""

    prompt: str | None
    token_ids: list[int]
    positions: torch.Tensor  # [3, prompt_len] int64 M-RoPE positions
    mrope_delta: int  # position of generated token i = prompt_len + i + delta
    images: list[ImageInput] = field(default_factory=list)

    @property
    def num_image_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        eos_token_ids: set[int],
        priority: Priority = Priority.INTERACTIVE,
        deadline_s: float | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt.token_ids
        self.num_prompt_tokens = len(prompt.token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.deadline = None if deadline_s is None else self.arrival_time + deadline_s
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []  # one per output token, if asked
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.block_hashes: list[bytes] = []  # hash chain of full blocks (prefix caching)
        self.deferred_steps = 0  # consecutive steps its prefill was held back by the ITL target
        self.held_decode_steps = 0  # consecutive encoder-only steps its decode sat out
        self.generator: torch.Generator | None = None
        # constrained decoding: the matcher, set at admission (engine/structured_output.py)
        self.grammar: GrammarState | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        """More than the newest token left to compute (recompute after preemption), or any
        prompt token: a prompt's last token left alone by a chunk is still prompt work (it may
        be an image token, and the decode path embeds ids only)."""
        return (
            self.num_computed_tokens < self.num_prompt_tokens
            or self.num_tokens - self.num_computed_tokens > 1
        )

    def token_ids(self, start: int, end: int) -> list[int]:
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:  # decode: no copy of the prompt
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end-start] M-RoPE positions for token indices [start, end)."""
        n = self.num_prompt_tokens
        if start >= n:  # generated tokens only (every decode): one op, not four
            lo = start + self.prompt.mrope_delta
            return torch.arange(lo, lo + end - start, dtype=torch.long).expand(3, -1)
        parts = []
        if start < n:
            parts.append(self.prompt.positions[:, start : min(end, n)])
        if end > n:
            lo = max(start, n)
            gen = torch.arange(lo, end, dtype=torch.long) + self.prompt.mrope_delta
            parts.append(gen.unsqueeze(0).expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def text_position(self, index: int) -> int | None:
        """The position of token ``index`` if it is a generated one (its three M-RoPE axes
        are equal), else None."""
        if index < self.num_prompt_tokens:
            return None
        return index + self.prompt.mrope_delta

    def full_block_hashes(self, num_tokens: int, block_size: int) -> list[bytes]:
        """Hashes of the full blocks among the first ``num_tokens`` tokens (extended lazily)."""
        from engine.kv_cache_manager import hash_block

        full = num_tokens // block_size
        while len(self.block_hashes) < full:
            i = len(self.block_hashes)
            start, end = i * block_size, (i + 1) * block_size
            images = tuple(
                (
                    im.content_hash,
                    max(start, im.offset) - im.offset,
                    min(end, im.offset + im.num_tokens) - im.offset,
                )
                for im in self.prompt.images
                if im.offset < end and im.offset + im.num_tokens > start
            )
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block(parent, self.token_ids(start, end), images))
        return self.block_hashes[:full]

    @property
    def finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed="
            f"{self.num_computed_tokens}/{self.num_tokens}, out={len(self.output_token_ids)})"
        )
