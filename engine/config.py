"""Engine configuration: one dataclass whose fields are vLLM's engine-argument names.

The same fields become CLI flags (``--max-num-batched-tokens`` ...) and environment variables
(``VISION_SERVE_MAX_NUM_BATCHED_TOKENS``) through :func:`add_engine_cli_args`, so the offline API,
the server and compose share one source of truth.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path

from engine.step_budget import AUTO, StepLimits

ENV_PREFIX = "VISION_SERVE_"


@dataclass
class EngineArgs:
    model: str = ""  # checkpoint directory, or a Hugging Face Hub id (engine.model_source)
    revision: str | None = None  # Hub branch, tag or commit of a Hub id (None: main)
    # sampling defaults: "auto" (the checkpoint's generation_config.json), "vllm" (none), or a
    # directory holding a generation_config.json (engine.generation_config)
    generation_config: str = "auto"
    dtype: str = (
        "auto"  # auto | float32 | bfloat16 | float16 ("auto": bf16 on CPUs with bf16 units)
    )
    device: str = "auto"  # auto | cpu | cuda
    # None: steps sized by predicted time (target_itl_ms, max_step_ms: auto) under a token cap;
    # a number: a fixed token budget per step, time limits only where asked for
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request cap below the step budget
    enable_prefix_caching: bool = True
    # step-time limits: ms, "auto" or "off"; None: auto when steps are sized by time, off
    # with a fixed --max-num-batched-tokens
    target_itl_ms: str | None = None  # while interactive requests are active
    max_step_ms: str | None = None  # any step (batch-only work included)
    auto_itl_factor: float = 1.25  # "auto" target = this x the predicted decode-only step
    # with no interactive work in the engine, a step may run many times the step bound and
    # stops at safe points (parts of decoder layers, vision items) when a chat request is queued
    interruptible_steps: bool = True
    encoder_cache_size: int = 16384  # image embeddings (tokens) kept for reuse
    enable_chunked_encoder: bool = True  # image encoding advanced under the step budget
    # granularity of encoder work (patch rows per item); None: 64 on CPUs with bf16 arithmetic,
    # 256 on other CPUs, whole stages on GPUs
    encoder_rows_per_item: int | None = None
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU (None: torch default)
    # waiting requests before new ones get 429 (0: unbounded); bounded by default so a burst
    # cannot queue unbounded decoded images
    max_queue_len: int = 256
    preprocess_workers: int = 2
    # image size bounds (pixels) every image is resized into; None: the checkpoint's processor's.
    # Image tokens scale with pixels, so this is the cheapest lever on a frame's cost.
    max_pixels: int | None = None
    min_pixels: int | None = None
    cpu_kernels: bool = True  # bf16 CPU: native decode step and prefill attention (engine/kernels)
    # GPU: decode-only steps run eagerly, not as replayed CUDA graphs (vLLM's flag)
    enforce_eager: bool = False
    # weight-only quantization of the decoder's linears (vLLM's flag); None: weights as loaded
    quantization: str | None = None
    # a JSON line per step (budget, prediction, encoder work) appended here; None: off
    step_trace: str | None = None

    def __post_init__(self) -> None:
        if self.quantization in ("", "none", "None"):
            self.quantization = None
        if self.quantization is not None and self.quantization not in ("int8",):
            raise ValueError(f"quantization must be 'int8' (or unset); got {self.quantization!r}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        for name in ("min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels must be <= max_pixels")
        self.step_limits()  # validate early
        if self.step_trace:
            _check_writable_file("step_trace", self.step_trace)

    def model_path(self) -> Path:
        """The local checkpoint directory, fetched from the Hub first if ``model`` is a Hub id
        (raises :class:`engine.model_source.ModelSourceError` when it cannot be had)."""
        from engine.model_source import resolve_model_path

        return resolve_model_path(self.model, self.revision)

    @property
    def time_sized(self) -> bool:
        """Steps sized by predicted time unless the user fixed a token budget."""
        return self.max_num_batched_tokens is None

    def target_itl_s(self) -> float | str | None:
        """``target_itl_ms`` as the scheduler wants it: seconds, "auto" or None (off)."""
        return _time_limit("target_itl_ms", self.target_itl_ms, self.time_sized)

    def step_limits(self) -> StepLimits:
        """The step policy: a token cap and the time limits, defaults resolved."""
        return StepLimits(
            max_tokens=self.max_num_batched_tokens or TIME_SIZED_TOKEN_CAP,
            target_itl_s=self.target_itl_s(),
            max_step_s=_time_limit("max_step_ms", self.max_step_ms, self.time_sized),
            auto_itl_factor=self.auto_itl_factor,
        )


def _check_writable_file(name: str, path: str) -> None:
    """Refuse at start-up a file the engine could not append to later (an existing folder,
    or a folder chain without write permission), without creating anything yet."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise ValueError(f"{name} {path!r} is a folder; give a file path")
    if target.exists():
        if not os.access(target, os.W_OK):
            raise ValueError(f"{name} {path!r} is not writable")
        return
    parent = target.parent
    while not parent.exists():  # the missing folders will be made: the first existing decides
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path!r}: cannot create it under {str(parent)!r}")


# tokens per step when steps are sized by time: a bound on activation memory, not the budget
TIME_SIZED_TOKEN_CAP = 8192


def _time_limit(name: str, value: str | float | None, time_sized: bool) -> float | str | None:
    """A ms flag as seconds, "auto" or None (off); unset means auto only when time-sized."""
    if value is None or str(value) == "":
        return AUTO if time_sized else None
    text = str(value).lower()
    if text in ("none", "off"):
        return None
    if text == AUTO:
        return AUTO
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of ms, 'auto' or 'off'; got {value!r}") from None
    if not ms > 0 or ms == float("inf"):
        raise ValueError(f"{name} must be a positive number of ms")
    return ms / 1e3


HELP = {
    "model": "checkpoint directory (Hugging Face layout: config.json, *.safetensors, processor) "
    "or a Hugging Face Hub id (org/name), fetched into the HF cache (HF_HOME, HF_HUB_CACHE; "
    "HF_TOKEN for gated models; HF_HUB_OFFLINE=1: cache only)",
    "revision": "branch, tag or commit of a Hub --model (default: main)",
    "generation_config": "sampling defaults for fields a request leaves out: 'auto' (the "
    "checkpoint's generation_config.json), 'vllm' (none: OpenAI's), or a folder holding one",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: bf16 where the CPU/GPU runs it fast)",
    "device": "auto | cpu | cuda",
    "max_num_batched_tokens": "fixed token budget of one step (decodes + prefill chunks); "
    "default: steps sized by predicted time (--target-itl-ms, --max-step-ms) under a cap of "
    "8192 tokens",
    "max_num_seqs": "most requests running at once",
    "max_model_len": "context length (default: the model's max_position_embeddings)",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "KV-cache blocks (default: from --kv-cache-memory-gb)",
    "kv_cache_memory_gb": "memory for the KV cache when --num-kv-blocks is not given",
    "enable_chunked_prefill": "split long prompts across steps (off: whole prompt in one step)",
    "long_prefill_token_threshold": "cap on one request's prefill chunk per step (0: none)",
    "enable_prefix_caching": "reuse KV blocks of identical prefixes (text and images)",
    "target_itl_ms": "step-time target (ms) while interactive requests are active; 'auto' "
    "(default when steps are sized by time): --auto-itl-factor x the decode step; 'off'",
    "max_step_ms": "bound (ms) on a step's predicted time, so an arriving chat request waits "
    "at most one short step (chat prompts while no chat decodes, with nobody to stall, get the "
    "token cap alone); 'auto' (default when sized by time): 4x the decode step, >= 50 ms",
    "interruptible_steps": "with steps sized by time and no interactive request in the engine, "
    "let a step run as many --max-step-ms as keep each part of a decoder layer (attention, "
    "gate/up, down) within one, and give it up between parts (or vision work items) when a "
    "chat request arrives, so camera-only work pays the "
    "per-step weight read far less often (engine/step_interrupt.py); off: every step short",
    "auto_itl_factor": "with --target-itl-ms auto: target = factor x decode-only step time",
    "encoder_cache_size": "image embeddings (in tokens) kept for reuse",
    "enable_chunked_encoder": "advance image encoding under the step budget (off: whole image)",
    "encoder_rows_per_item": "patch rows per unit of encoder work (smaller: finer steps; 0: whole "
    "stages; default 512 on CPUs with AMX, 64 on other CPUs with bf16 arithmetic, 256 on the "
    "rest, 0 on GPUs)",
    "seed": "global seed (per-request seeds come from SamplingParams)",
    "num_threads": "torch CPU threads (default: torch's choice)",
    "max_queue_len": "waiting requests before new ones are refused with 429 and Retry-After "
    "(default 256; 0: unbounded)",
    "preprocess_workers": "threads decoding and preprocessing images off the step loop, per "
    "priority class (batch requests' threads run at nice 10)",
    "max_pixels": "most pixels an image is resized to (fewer image tokens; default: checkpoint's)",
    "min_pixels": "fewest pixels an image is resized to (default: the checkpoint's)",
    "quantization": "int8: decoder linears as int8 weights with per-channel scales, computed "
    "in fp32 (CPU; a quarter of fp32's bytes per decode step)",
    "step_trace": "append one JSON line per engine step to this file (target, predicted and "
    "measured seconds, decodes, prompt tokens, encoder work granted and run): to see why chat "
    "ITL or camera throughput is what it is (engine/step_trace.py); default: off",
    "enforce_eager": "GPU: run decode-only steps eagerly instead of as CUDA graphs captured per "
    "batch and context bucket on first use (graphs cut a small model's launch-bound step "
    "several-fold; eager saves their memory and capture time)",
    "cpu_kernels": "bf16 CPU: decode-only steps as one native call, prefill and vision attention "
    "in a native flash kernel (built on first use; PyTorch where they cannot run)",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per EngineArgs field; defaults come from env vars when set."""
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in fields(EngineArgs):
        if f.name in skip:
            continue
        tp = hints[f.name]
        if isinstance(tp, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        env = os.environ.get(ENV_PREFIX + f.name.upper())
        default = f.default if f.default is not dataclasses.MISSING else None
        if tp is bool:
            if env is not None:
                default = env.lower() in ("1", "true", "yes", "on")
            group.add_argument(
                _flag(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=HELP.get(f.name),
            )
        else:
            if env is not None:
                default = tp(env)
            group.add_argument(
                _flag(f.name), dest=f.name, type=tp, default=default, help=HELP.get(f.name)
            )
    if "enable_chunked_prefill" not in skip:
        group.add_argument(
            "--no-chunked-prefill",
            dest="enable_chunked_prefill",
            action="store_false",
            help="alias of --no-enable-chunked-prefill",
        )


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})
