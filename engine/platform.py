"""The platform plan: every hardware-dependent choice of the engine, made once at start.

Why one place: which dtype, which native kernel build, how linears are stored (oneDNN-packed,
bf16 widened for prefill, int8) and how big a vision work item is all follow from the same few
facts -- the device, whether the CPU has bf16 arithmetic, which instruction set the kernels are
built for. Decided in separate functions, each probing the CPU again, they drifted apart (a
kernel build on a CPU whose linears still took oneDNN's emulated bf16 path). Here they are
resolved together into a frozen :class:`PlatformPlan`, logged as one line, and the model loader
and the engine read it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.device import (
    LESSER_CPU_LIBRARY_ENV,
    cpu_family,
    cpu_has_amx,
    cpu_has_fast_bf16,
    cpu_vendor,
    planned_as_lesser_cpu,
    resolve_device,
    resolve_dtype,
)

if TYPE_CHECKING:
    from engine.config import EngineArgs

log = logging.getLogger("engine")

# vision work-item rows (engine.models.qwen2_vl VisionEncodeJob) by platform: with bf16
# arithmetic 64-row items keep CPU steps short at little cost; in fp32, or where bf16 is
# emulated (each item widens every weight it touches), small items cost a fifth of a frame's
# encode, so 256 (2.04 -> 1.77 s emulated, 2.04 -> 1.58 s fp32 on a 2-core Ice Lake); on a
# GPU a 64-row item is all launch overhead (0.25 s per frame in items, 0.01 s whole)
ENCODER_ROWS_BF16_ARITHMETIC = 64
ENCODER_ROWS_CPU_OTHER = 256
# with AMX (torch's flash kernel, oneDNN in tiles) an item's fixed cost is most of a small
# one: a 640x480 bench frame in items of 64 rows 1.83 s, 128 1.49, 256 1.26, 512 0.85, 1,024
# 0.74 (slowest item 15 and 23 ms), whole 0.96 (2-core AMX Xeon); the scheduler still cuts an
# item down to what a step grants, so big items cost chat nothing
ENCODER_ROWS_AMX = 512

# rows (decodes + prompt tokens) a step with prompt tokens may hold and still run the fused
# kernel (engine/model_runner.py says why prompt rows ride it at all). Where its linears past
# a few rows are oneDNN's packed GEMM on bf16 arithmetic, the eager forward runs the same GEMM
# and adds only per-op overhead: the fused step is as fast or faster at every chunk size
# measured (2-core Zen 5 EPYC, bench, a 1,024-token prompt in chunks, ms a token fused /
# eager: 0.42 / 0.59 at 32 rows, 0.36 / 0.51 at 64, 0.33 / 0.38 at 128, 0.30 / 0.32 at 256,
# 0.31 / 0.31 at 1,024; a 4,096-token prompt in 2,048- and 4,096-row chunks 0.37 either way).
# The old limit of 64 rows capped the step bound's batch-only chunks there, since a 65th row
# paid the eager floor (~9 ms): camera-only work cost 19 % against a fixed 2,048-token budget,
# 8-12 % at 1,024 rows (benchmarks.default_cost; the fixed budget's own one-shot prompts got
# faster too). On the emulated builds' panel GEMV, past 16 rows a prompt
# row gains little on an eager chunk's and such steps outlast the default step bound anyway
# (2-core AVX2 EPYC, bench, 1,200-token prompt: 2.1-2.2 ms a token fused at 16 rows since
# session 16; before it 2.7-3.3 at 16, 2.4-2.7 at 32, 3.0 at 64; eager 1.6 at 512).
FUSED_PROMPT_ROWS_PACKED = 1024
FUSED_PROMPT_ROWS_PANELS = 16
# With AMX, long prompt chunks attended faster through torch's flash kernel in the eager
# forward than through the fused kernel's own attention (then AVX512-BF16 dot products): a
# 1,024-token prompt in chunks, ms a token fused / eager (two runs, in turns, 2-core AMX
# Xeon): 64 rows 0.57-0.59 / 0.63-0.76, 128 0.42-0.52 / 0.44-0.71, 256 0.41-0.54 / 0.35-0.63,
# 512 0.49 / 0.37, 1,024 0.36 / 0.26. Since session 23 both attend on AMX tiles
# (amx_attention below); the limit was not re-measured.
FUSED_PROMPT_ROWS_AMX = 256

# The native build's row-major GEMV: asking for each weight row 4 KiB ahead keeps memory busy
# where the hardware prefetcher alone left it idle at every new row, and with it the GEMV beats
# oneDNN's packed GEMM up to a dozen rows or more. Measured in turns inside one process
# (``python -m benchmarks.weight_prefetch``, bench checkpoint, 2 cores):
# - AVX512-BF16 Xeon (Emerald Rapids): batch 1 12.2-12.9 -> 9.6-10.0 ms, batch 4 17.7 -> 10.9,
#   the GEMV up to 16 rows (batch 8: 21.0 -> 14.0 ms, batch 16: 40.7 -> 29.6 ms).
# - AVX512-BF16 EPYC, Zen 5 (family 26): batch 1 6.65 -> 5.96 ms, batch 4 8.36 -> 6.82, batch 8
#   10.3 (oneDNN) -> 6.3-6.7 (GEMV), batch 12 10.3-10.7 -> 9.1-9.3; at 16 oneDNN wins (10.9-11.3
#   against 13.8-14.1), so the GEMV stops at 12 rows there.
# - AMX Xeon (family 6 model 167, 2 cores): in-process, oneDNN's GEMM runs in tiles and
#   catches up with the GEMV at 8 rows (14.2-14.4 ms either way; batch 4 10.6-10.9 GEMV
#   against 14.0, batch 12 15.2 against 20.7, batch 16 16.3 against 28.6). In the server it
#   did not: steps of 4 chat decodes and 5-7 camera prompt rows (9-11 rows) ran 2.2x a
#   decode-only step through oneDNN against 1.8-1.95x through the GEMV, and chat ITL p99 under
#   the issue-14 workload read 1.77-1.89x alone against 1.36-1.54x (two server runs each,
#   session 20). The server is what users run: AMX keeps Intel's 16 rows.
# - AMX Xeons since session 22: that GEMV runs on AMX tiles (engine/kernels/amx_gemv.h), the
#   weights packed a second time as 16 x 32 tiles. In turns inside one engine
#   (``python -m benchmarks.weight_prefetch --batches 1 4 8 12 16 --distances 4096``, a slow
#   minute of the 2-core family 6 model 167 machine): batch 1 16.5 against 17.4 ms, batch 4
#   17.8 / 17.0, batch 8 19.6 / 23.3, batch 12 21.0 / 31.0, batch 16 24.5 / 40.3 (oneDNN's GEMM
#   past 4 rows: 37-42 ms at 8-16 rows that minute). The dot product is compute-bound from a
#   few rows here; tiles read the weights at any row count up to 16.
# - Since session 35 the GEMV's steps of 2+ rows multiply bf16 panels (the emulated builds'
#   layout, engine/kernels/cpu_decode.cpp ``panel_block_dot``), not the row-major weights: on a
#   Zen 4 EPYC (family 25: the only AMD family 25 with AVX512-BF16) decode steps in turns
#   against the row-major GEMV of up to 4 rows and oneDNN past them (``benchmarks.weight_prefetch
#   --batches 1 2 4 8 12 16 --gemv-rows 4 12 16``): batch 4 6.6-7.2 against 8.8 ms, batch 8
#   8.4-8.9 against 11.1, batch 12 10.9-11.3 against 13.7, batch 16 the same as oneDNN (15.9-16.1
#   against 16.1). So Zen 4 takes the GEMV to 16 rows; its 1-row steps keep the row-major kernel
#   and the hardware prefetcher alone (4 KiB ahead: 6.6 against 6.1 ms). Zen 5's 12 rows and
#   Intel's 16 were measured with the row-major GEMV and are not re-measured with panels.
NATIVE_PREFETCH_BYTES = 4096
GEMV_ROWS_DEFAULT = 4


def native_gemv_tuning(vendor: str, family: int) -> tuple[int, int]:
    """(GEMV row limit, weight prefetch bytes) of the native-bf16 build on this CPU."""
    if vendor == "GenuineIntel":
        return 16, NATIVE_PREFETCH_BYTES
    if vendor == "AuthenticAMD" and family >= 26:
        return 12, NATIVE_PREFETCH_BYTES
    if vendor == "AuthenticAMD" and family == 25:
        return 16, 0
    return GEMV_ROWS_DEFAULT, 0


def gemv_row_major_needed(prefetch_bytes: int, amx_tiles: bool) -> bool:
    """Whether the native build keeps the decoder's row-major bf16 copy, a third of the
    weight memory it holds (row-major, panels, oneDNN's packing: 3 GB each on a 2B-class
    decoder). Its only reader is the 1-row dot-product GEMV; where that kernel relies on the
    hardware prefetcher alone the panels run 1-row steps nearly as fast, and the memory is
    worth more on an edge box than the difference (Zen 4, batch-1 ``bench`` decode steps in
    turns inside one process: ``python -m benchmarks.load_memory`` 5.74 against 5.58 ms and
    6.81 against 6.69, ``python -m benchmarks.weight_prefetch --batches 1 2 4 --distances 0``
    7.13 against 6.83 -- 2-4 % slower, where that run read the same code 4-6 % apart at
    batches 2 and 4 -- for 190 MiB less resident). Kept where its weight prefetch was tuned
    against the hardware's (Intel, Zen 5: not re-measured against panels; ``--kinds dot
    panels`` of that benchmark does it) and on AMX, whose tiles are laid out from it."""
    return prefetch_bytes > 0 or amx_tiles


@dataclass(frozen=True)
class PlatformPlan:
    """What this engine runs on and how; read-only after start."""

    device: torch.device
    dtype: torch.dtype
    bf16_arithmetic: bool  # AVX512-BF16/AMX on a CPU, or a GPU
    kernel_variant: str | None  # engine.kernels build this CPU runs (None: no build applies)
    use_cpu_kernels: bool  # the fused decode step and native attention are wanted
    quantization: str | None
    # CPU linears replaced at load (oneDNN-packed, or bf16 widened for prefill): the decoder's
    # unless quantized, and the vision tower's where the kernels or emulated bf16 need it
    cpu_linears: bool
    linear_kind: str  # the decoder's: "int8" | "bf16-upcast" | "onednn-packed" | "plain"
    vision_dtype: torch.dtype
    encoder_rows_per_item: int | None  # None: whole encoder stages per item
    fused_prompt_rows: int  # most rows of a step with prompt tokens in the fused kernel
    # the fused kernel's own GEMV (native build: bf16 panels from 2 rows, or from 1, see
    # gemv_row_major): most rows it takes before oneDNN's packed GEMM, and how far ahead the
    # row-major kernel asks for weights (0: the hardware prefetcher alone)
    gemv_max_rows: int = GEMV_ROWS_DEFAULT
    weight_prefetch_bytes: int = 0
    # the native build keeps a row-major copy of the decoder's bf16 matrices for its 1-row
    # GEMV (beside the panels and oneDNN's packing): only where that kernel's tuned prefetch
    # was measured or AMX tiles are laid out from it. Elsewhere the panels take 1-row steps too
    # and the copy is let go (see gemv_row_major_needed)
    gemv_row_major: bool = True
    # that GEMV on AMX tiles (engine/kernels/amx_gemv.h) rather than AVX512-BF16 dot products;
    # int8 matrices from 5 rows on AMX-INT8 tiles rather than their panels
    gemv_amx_tiles: bool = False
    # prompt chunks and the vision tower attend through torch's flash kernel, not
    # engine.kernels': on AMX it computes bf16 in tiles (decodes stay on the paged kernel);
    # only where engine.kernels' own attention has no AMX tiles (amx_attention)
    torch_flash_attention: bool = False
    # engine.kernels' flash attention (prompt chunks, fused or eager, and the vision tower)
    # with its products on AMX tiles (engine/kernels/amx_attention.h)
    amx_attention: bool = False
    # decode-only steps as replayed CUDA graphs ("cuda") or eager ("off"); engine/cuda_graphs.py
    # ("eager", the graphs' padded forward without capture, is for tests on a CPU)
    decode_graphs: str = "off"

    @property
    def int8_activation_bits(self) -> int | None:
        """What an int8 model's fused decode step rounds its activations to (one scale per row
        and 256 inputs; the kernel module's ``int8_activation_bits`` decides the same): 16
        where AMX-INT8 tiles share them with the panels, 0 where int8 weights are widened to
        fp32 (AVX-512 without VNNI) or no fused step runs, 8 elsewhere; None without int8."""
        if self.quantization != "int8":
            return None
        if not self.use_cpu_kernels or self.kernel_variant == "emulated-bf16":
            return 0
        return 16 if self.gemv_amx_tiles else 8

    @property
    def int8_i16_rows(self) -> int:
        """Steps of up to this many rows keep int16 activations where int8_activation_bits is
        8 (VNNI without AMX, the module's ``int8_i16_rows``): few rows stream weights whatever
        the product."""
        vnni = self.kernel_variant in ("native-bf16", "emulated-bf16-vnni")
        return 4 if vnni and self.int8_activation_bits == 8 else 0

    @property
    def emulated_bf16(self) -> bool:
        """bf16 weights on a CPU without bf16 arithmetic: products widen them to fp32."""
        return (
            self.device.type == "cpu"
            and self.dtype == torch.bfloat16
            and not (self.bf16_arithmetic)
        )

    def describe(self) -> str:
        return (
            f"platform_plan device={self.device} dtype={_name(self.dtype)} "
            f"bf16_arithmetic={self.bf16_arithmetic} kernels={self.kernel_variant or 'none'}"
            f"{'' if self.use_cpu_kernels else ' (off)'} linears={self.linear_kind} "
            f"quantization={self.quantization or 'none'} vision_dtype={_name(self.vision_dtype)} "
            f"encoder_rows_per_item={self.encoder_rows_per_item or 'whole'} "
            f"fused_prompt_rows={self.fused_prompt_rows} gemv_max_rows={self.gemv_max_rows} "
            f"weight_prefetch={self.weight_prefetch_bytes} "
            f"gemv_1_row={'row-major' if self.gemv_row_major else 'panels'} "
            f"gemv={'amx-tiles' if self.gemv_amx_tiles else 'dot'} "
            f"prefill_attention={self.prefill_attention} decode_graphs={self.decode_graphs}"
            + ("" if self.quantization != "int8" else f" int8_act_bits={self.int8_activation_bits}")
            + (f" (16 to {self.int8_i16_rows} rows)" if self.int8_i16_rows else "")
        )

    @property
    def prefill_attention(self) -> str:
        if self.amx_attention:
            return "amx-tiles"
        return "torch-flash" if self.torch_flash_attention else "native"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def vision_compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The vision tower's dtype: the model's, except bf16 on a CPU without bf16 arithmetic.

    There every bf16 product is computed in fp32 anyway (widened weights, engine.kernels'
    emulated attention), and a bf16 tower only adds conversions and rounding: per 256-row
    item each linear widened its weight and converted its input and output, ~10 % of a
    frame. The tower is ~2 % of a bench checkpoint's weights, so fp32 costs little memory;
    its output is cast to the model's dtype where it enters the decoder.
    """
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_fast_bf16():
        return torch.float32
    return dtype


def encoder_rows_per_item(
    device: torch.device, dtype: torch.dtype, requested: int | None = None
) -> int | None:
    """Encoder work granularity (``--encoder-rows-per-item``; 0 or None on a GPU: whole)."""
    rows = requested
    if rows is None:
        if device.type != "cpu":
            rows = 0
        elif dtype == torch.bfloat16 and cpu_has_amx():
            rows = ENCODER_ROWS_AMX
        elif dtype == torch.bfloat16 and cpu_has_fast_bf16():
            rows = ENCODER_ROWS_BF16_ARITHMETIC
        else:
            rows = ENCODER_ROWS_CPU_OTHER
    return rows or None


def plan_platform(
    device: torch.device,
    dtype: torch.dtype,
    cpu_kernels: bool = True,
    quantization: str | None = None,
    pack_cpu_weights: bool = True,
    requested_encoder_rows: int | None = None,
    enforce_eager: bool = False,
) -> PlatformPlan:
    """The plan for an already chosen device and dtype (tests and benchmarks load models
    this way; the engine goes through :func:`resolve_platform`)."""
    from engine.kernels import cpu_variant
    from engine.layers.linear import cpu_packing_available

    on_cpu = device.type == "cpu"
    bf16_arithmetic = device.type == "cuda" or (on_cpu and cpu_has_fast_bf16())
    if quantization is not None and not on_cpu:
        raise ValueError(f"--quantization {quantization} runs on CPU only for now")
    variant = cpu_variant() if on_cpu else None
    # the fused decode step keeps bf16 activations and reads bf16 or int8 weights (int8 with
    # fp32 activations, --dtype float32, decodes eager with engine/kernels/int8_linear.cpp)
    use_kernels = (
        on_cpu
        and dtype == torch.bfloat16
        and cpu_kernels
        and quantization in (None, "int8")
        and variant
    )
    emulated = on_cpu and dtype == torch.bfloat16 and not bf16_arithmetic
    # no oneDNN bf16 packing is needed where bf16 is emulated (AVX2 CPUs have none): the
    # weights stay bf16 for the kernels and are widened for prefill-sized products
    cpu_linears = on_cpu and pack_cpu_weights and (emulated or cpu_packing_available(dtype))
    if quantization is not None:
        linear_kind = quantization
    elif not cpu_linears:
        linear_kind = "plain"
    else:
        linear_kind = "bf16-upcast" if emulated else "onednn-packed"
    # On AMX our flash kernel runs its products in tiles (amx_attention.h): on a 2-core AMX
    # Xeon (python -m benchmarks.attention) 3-5x its AVX512-BF16 dot products, 2.4-2.8x
    # torch's flash kernel on prompt chunks (128 rows against 1,200 keys, bench heads: 1.46
    # against 5.39 and 3.51 ms a layer; torch needs a mask for the chunk's causal offset) and
    # 1.1-1.3x on the vision tower's pieces (one head's 256 rows against 4,800 keys: 1.31
    # against 1.65 ms). Without our kernels there, torch's flash kernel, which runs bf16 on
    # AMX tiles too: a 640x480 frame's tower 2.5x faster than through our dot products.
    amx_attention = bool(use_kernels) and variant == "native-bf16" and cpu_has_amx()
    torch_flash = on_cpu and dtype == torch.bfloat16 and cpu_has_amx() and not amx_attention
    # bf16 row-major weights only: int8 matrices run their own panels
    gemv_rows, prefetch_bytes = (
        native_gemv_tuning(cpu_vendor(), cpu_family())
        if use_kernels and quantization is None and variant == "native-bf16"
        else (GEMV_ROWS_DEFAULT, 0)
    )
    # int8 matrices take AMX-INT8 tiles from 5 rows (engine/kernels/amx_gemv.h; 1-4 rows stay
    # on their panels): the bench decoder's matrices at 8 rows 9.4-10.2 ms a pass against
    # 10.7-11.4, 16 rows 13.8-14.7 against 18.3-18.5 (2-core AMX Xeon, in turns)
    gemv_tiles = amx_attention and quantization in (None, "int8")
    native_bf16_packed = (
        bool(use_kernels)
        and quantization is None
        and variant == "native-bf16"
        and linear_kind == "onednn-packed"
    )
    return PlatformPlan(
        device=device,
        dtype=dtype,
        bf16_arithmetic=bf16_arithmetic,
        kernel_variant=variant,
        use_cpu_kernels=bool(use_kernels),
        quantization=quantization,
        cpu_linears=cpu_linears,
        linear_kind=linear_kind,
        vision_dtype=vision_compute_dtype(dtype, device),
        encoder_rows_per_item=encoder_rows_per_item(device, dtype, requested_encoder_rows),
        fused_prompt_rows=(
            0
            if not use_kernels
            else FUSED_PROMPT_ROWS_PANELS
            if linear_kind != "onednn-packed"
            else FUSED_PROMPT_ROWS_AMX
            if torch_flash or amx_attention
            else FUSED_PROMPT_ROWS_PACKED
        ),
        gemv_max_rows=gemv_rows,
        weight_prefetch_bytes=prefetch_bytes,
        gemv_row_major=not native_bf16_packed
        or gemv_row_major_needed(prefetch_bytes, bool(gemv_tiles)),
        gemv_amx_tiles=bool(gemv_tiles),
        torch_flash_attention=torch_flash,
        amx_attention=amx_attention,
        decode_graphs="cuda" if device.type == "cuda" and not enforce_eager else "off",
    )


def resolve_platform(args: EngineArgs) -> PlatformPlan:
    """The engine's plan from its arguments, logged once."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, cpu_kernels=args.cpu_kernels)
    plan = plan_platform(
        device,
        dtype,
        cpu_kernels=args.cpu_kernels,
        quantization=args.quantization,
        requested_encoder_rows=args.encoder_rows_per_item,
        enforce_eager=args.enforce_eager,
    )
    log.info(plan.describe())
    if plan.device.type == "cpu":
        _warn_unless_libraries_follow(plan.kernel_variant)
    return plan


def _warn_unless_libraries_follow(variant: str | None) -> None:
    """Under a lesser ``VISION_SERVE_CPU_VARIANT``, say which library settings this process
    lacks to run that CPU class's code in torch, oneDNN and MKL too (they read them at load:
    too late to set here), so a figure taken without them is not mistaken for that class's."""
    if variant is None or not planned_as_lesser_cpu():
        return
    missing = {
        key: value
        for key, value in LESSER_CPU_LIBRARY_ENV.get(variant, {}).items()
        if os.environ.get(key) != value
    }
    if missing:
        exports = " ".join(f"{key}={value}" for key, value in missing.items())
        log.warning(
            "planned for %s CPUs, but torch/oneDNN/MKL still run this CPU's widest code: "
            "start the process with %s",
            variant,
            exports,
        )
