"""Device and dtype resolution."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger("engine")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return device


def cpuinfo_field(name: str) -> str:
    """The first ``name`` line of /proc/cpuinfo (``model name``, ``vendor_id``); empty where
    there is none (not Linux, or a field this CPU does not report)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``; empty when unknown)."""
    return cpuinfo_field("vendor_id")


def cpu_family() -> int:
    """The CPU's family number (AMD: 25 for Zen 3/4, 26 for Zen 5); 0 when unknown."""
    value = cpuinfo_field("cpu family")
    return int(value) if value.isdigit() else 0


def _torch_cpu_probe(name: str) -> bool:
    """One of torch.cpu's private capability probes; False where this torch lacks it or it
    fails (tests/engine/test_device_defaults.py checks them against /proc/cpuinfo)."""
    fn = getattr(torch.cpu, name, None)
    try:
        return bool(fn is not None and fn())
    except Exception:
        return False


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run 2-8x faster than fp32 on such CPUs."""
    if planned_as_lesser_cpu():
        return False
    return cpu_has_amx() or _torch_cpu_probe("_is_avx512_bf16_supported")


def cpu_has_amx() -> bool:
    """AMX tiles (Xeons since Sapphire Rapids): oneDNN and torch's CPU flash attention run bf16
    products on them at several times the AVX512-BF16 rate."""
    if planned_as_lesser_cpu():
        return False
    return _torch_cpu_probe("_is_amx_tile_supported")


# what torch, oneDNN and MKL are told at start to run no wider than a CPU class: with
# VISION_SERVE_CPU_VARIANT, the whole process then runs that class's code (read when the
# libraries load, so set in the environment a process starts with)
LESSER_CPU_LIBRARY_ENV = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "emulated-bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "emulated-bf16-vnni": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
}


def planned_as_lesser_cpu() -> bool:
    """Whether ``VISION_SERVE_CPU_VARIANT`` (engine/kernels) has this process run a variant
    without bf16 arithmetic on a CPU that has it: the plan is then that class's (no native
    bf16, no AMX: eager bf16 linears widened to fp32, an fp32 vision tower), so an AVX-512 or
    AMX machine runs, tests and times what an AVX2-only or Ice Lake box would. Together with
    :data:`LESSER_CPU_LIBRARY_ENV` in the environment, torch's, oneDNN's and MKL's own code
    too; the hardware underneath stays this one (its clocks, caches and memory)."""
    from engine.kernels import forced_variant

    return forced_variant() not in (None, "native-bf16")


def resolve_dtype(name: str, device: torch.device, cpu_kernels: bool = True) -> torch.dtype:
    """``auto``: bf16 on GPUs and on CPUs that run it fast. On CPUs that is bf16 arithmetic
    (AVX512-BF16, AMX), or engine.kernels built (AVX-512 or AVX2): there bf16 is emulated, yet
    bf16 weights with the kernels are faster than fp32, since decode streams half the bytes
    through one fused call per step and prefill-sized products widen the weights to fp32
    (UpcastLinear). Measured (``benchmarks/README.md``): on a 2-core Ice Lake 1.6x the offline
    tokens/s of fp32; on a 2-core AVX2 EPYC (Zen 3) a decode step 2-3x faster at batch 1 and
    8, at 0.6-0.95x fp32's text-prefill rate (``benchmarks/cpu_dtype.py``): decode paces every
    stream, so bf16 wins there too. Elsewhere fp32."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        if cpu_kernels:
            from engine.kernels import load_cpu_decode

            if load_cpu_decode() is not None:
                return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}") from None


@contextlib.contextmanager
def attention_backends(device: torch.device) -> Iterator[None]:
    """SDPA without cuDNN on GPUs: cuDNN builds an execution plan per distinct shape, and a
    serving step's key lengths are new almost every step (measured on an H200: 9 ms per
    attention call, a 50 ms decode step for a model whose kernels take 2 ms). Flash and
    memory-efficient attention take any length without planning."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        yield


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def keep_freed_host_memory() -> None:
    """Ask glibc to keep freed blocks of up to 32 MiB for reuse. A step allocates and frees
    activations of a few MB; above glibc's mmap threshold each one was a fresh mapping that the
    kernel zeroed page by page on first touch (4 % of a frame's vision encode, measured with
    perf on a 2-core Ice Lake). Memory stays with the process, as a serving process wants."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc
        return
    if not ok:
        log.debug("mallopt refused; keeping the allocator's defaults")


def freeze_loaded_objects() -> None:
    """Move everything alive after loading (torch, transformers, the model, the tokenizer) out of
    the garbage collector's reach: it is never garbage, yet every young-generation collection
    during serving walked it (3 % of a frame's vision encode in ``gc_collect_main``)."""
    gc.collect()
    gc.freeze()
