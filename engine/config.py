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

ENV_PREFIX = "VISION_SERVE_"


@dataclass
class EngineArgs:
    model: str = ""
    dtype: str = (
        "auto"  # auto | float32 | bfloat16 | float16 ("auto": bf16 on CPUs with bf16 units)
    )
    device: str = "auto"  # auto | cpu | cuda
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request cap below the step budget
    enable_prefix_caching: bool = True
    # SLO-driven budget: target step time (ms) while interactive streams decode, or "auto"
    target_itl_ms: str | None = None
    auto_itl_factor: float = 1.25  # "auto" target = this x the predicted decode-only step
    encoder_cache_size: int = 16384  # image embeddings (tokens) kept for reuse
    enable_chunked_encoder: bool = True  # image encoding advanced under the step budget
    # granularity of encoder work (patch rows per item); None: 64 on CPUs with bf16 arithmetic,
    # 256 on other CPUs, whole stages on GPUs
    encoder_rows_per_item: int | None = None
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU (None: torch default)
    max_queue_len: int = 0  # 0: unbounded waiting queue
    preprocess_workers: int = 2
    cpu_kernels: bool = True  # bf16 CPU: native decode step and prefill attention (engine/kernels)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        self.target_itl_s()  # validate early

    def target_itl_s(self) -> float | str | None:
        """``target_itl_ms`` as the scheduler wants it: seconds, "auto" or None (off)."""
        value = self.target_itl_ms
        if value is None or str(value).lower() in ("", "none", "off"):
            return None
        if str(value).lower() == "auto":
            return "auto"
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(
                f"target_itl_ms must be a number of ms or 'auto', got {value!r}"
            ) from None
        if ms <= 0:
            raise ValueError("target_itl_ms must be positive")
        return ms / 1e3


HELP = {
    "model": "checkpoint directory (Hugging Face layout: config.json, *.safetensors, processor)",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: bf16 where the CPU/GPU runs it fast)",
    "device": "auto | cpu | cuda",
    "max_num_batched_tokens": "token budget of one step (decodes + prefill chunks)",
    "max_num_seqs": "most requests running at once",
    "max_model_len": "context length (default: the model's max_position_embeddings)",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "KV-cache blocks (default: from --kv-cache-memory-gb)",
    "kv_cache_memory_gb": "memory for the KV cache when --num-kv-blocks is not given",
    "enable_chunked_prefill": "split long prompts across steps (off: whole prompt in one step)",
    "long_prefill_token_threshold": "cap on one request's prefill chunk per step (0: none)",
    "enable_prefix_caching": "reuse KV blocks of identical prefixes (text and images)",
    "target_itl_ms": "SLO-driven budget: step-time target while chat decodes, or 'auto'",
    "auto_itl_factor": "with --target-itl-ms auto: target = factor x decode-only step time",
    "encoder_cache_size": "image embeddings (in tokens) kept for reuse",
    "enable_chunked_encoder": "advance image encoding under the step budget (off: whole image)",
    "encoder_rows_per_item": "patch rows per unit of encoder work (smaller: finer steps; 0: whole "
    "stages; default 64 on CPUs with bf16 arithmetic, 256 on other CPUs, 0 on GPUs)",
    "seed": "global seed (per-request seeds come from SamplingParams)",
    "num_threads": "torch CPU threads (default: torch's choice)",
    "max_queue_len": "waiting requests before new ones are refused (0: unbounded)",
    "preprocess_workers": "threads decoding and preprocessing images off the step loop",
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
