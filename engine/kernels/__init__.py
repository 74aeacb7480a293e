"""Native CPU kernels, compiled on first use with the machine's C++ compiler.

The fused decode step (``cpu_decode.cpp``) and the fused prefill attention
(``cpu_attention.cpp``) are optional: without a compiler, on a CPU with neither AVX-512 nor
AVX2, or when the build fails, :func:`load_cpu_decode` returns ``None`` and the engine runs its
eager PyTorch path, which gives the same tokens up to bf16 rounding.

The kernels are written once against a small vector vocabulary (``isa.h``) with one traits
header per instruction set (``isa/``), and built per variant (:data:`VARIANTS`): CPUs with
AVX512-BF16 get the bf16 dot-product instruction; plain AVX-512 CPUs (Skylake-X, Ice Lake) and
AVX2 CPUs (Haswell+, Zen 1-3, N100) a build that widens bf16 to fp32 in registers: there bf16
matmuls in oneDNN are emulated too, and the kernels matter most. Each variant is its own
module, cached by PyTorch under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``;
a home directory shared across CPUs keeps all of them) and reused until the source changes;
``python -m engine.kernels`` builds this CPU's ahead of time.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("engine.kernels")

_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_decode.cpp", "cpu_attention.cpp")]
_HEADERS = [Path(__file__).with_name("isa.h"), *sorted(Path(__file__).with_name("isa").glob("*.h"))]
_FLAGS = ["-O3", "-fopenmp"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
# variant -> the instruction-set flags that select its traits header (isa.h)
VARIANTS = {
    "native-bf16": [*_AVX512, "-mavx512bf16"],
    "emulated-bf16": _AVX512,
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
_MODULES = {
    "native-bf16": "vision_serve_cpu_decode",
    "emulated-bf16": "vision_serve_cpu_decode_bf16_emulated",
    "avx2": "vision_serve_cpu_decode_avx2",
}
DISABLE_ENV = "VISION_SERVE_DISABLE_CPU_KERNELS"


def _cpu_probe(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)
    try:
        return bool(probe and probe())
    except Exception:
        return False


def cpu_supports_avx512_bf16() -> bool:
    return _cpu_probe("_is_avx512_bf16_supported")


def cpu_supports_avx512() -> bool:
    """AVX-512 F/BW/VL/DQ, as PyTorch's own AVX512 kernels require."""
    return _cpu_probe("_is_avx512_supported")


def cpu_supports_avx2() -> bool:
    """AVX2 as PyTorch's own AVX2 kernels require it (with FMA); every such CPU has F16C."""
    return _cpu_probe("_is_avx2_supported")


def cpu_variant() -> str | None:
    """The kernel variant this CPU runs (a key of :data:`VARIANTS`), or ``None``."""
    if cpu_supports_avx512():
        return "native-bf16" if cpu_supports_avx512_bf16() else "emulated-bf16"
    if cpu_supports_avx2():
        return "avx2"
    return None


@functools.cache
def load_cpu_decode() -> ModuleType | None:
    """The compiled fused-decode module, or ``None`` where it cannot run (reason logged)."""
    if os.environ.get(DISABLE_ENV, "").lower() in ("1", "true", "yes"):
        log.info("cpu kernels disabled by %s", DISABLE_ENV)
        return None
    variant = cpu_variant()
    if variant is None:
        log.info("cpu kernels skipped: this CPU has neither AVX-512 nor AVX2")
        return None
    from torch.utils.cpp_extension import load

    # PyTorch rebuilds when the sources or flags change, not the headers: their hash goes in
    # as a flag
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in _HEADERS)).hexdigest()[:16]
    t0 = time.perf_counter()
    try:
        module = load(
            # one build per variant: a home directory shared across CPUs keeps all of them
            name=_MODULES[variant],
            sources=[str(p) for p in _SOURCES],
            extra_cflags=[*_FLAGS, *VARIANTS[variant], f"-DVS_HEADERS_{headers}"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:
        log.warning("cpu kernels unavailable, using the eager path: %s", exc)
        return None
    log.info(
        "cpu kernels ready in %.1f s (variant %s: bf16 dot products %s)",
        time.perf_counter() - t0,
        variant,
        "native" if module.bf16_dot else "emulated",
    )
    return module


INT8_SOURCE = Path(__file__).with_name("int8_linear.cpp")
INT8_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


@functools.cache
def load_int8_linear() -> ModuleType | None:
    """The AVX2 weight-only int8 GEMV (``int8_linear.cpp``), or ``None`` where it cannot run:
    :class:`engine.layers.quantized.Int8Linear` then dequantizes with PyTorch ops (same
    numbers, slower)."""
    if os.environ.get(DISABLE_ENV, "").lower() in ("1", "true", "yes"):
        return None
    if not cpu_supports_avx2():
        log.info("int8 kernel skipped: this CPU has no AVX2")
        return None
    from torch.utils.cpp_extension import load

    t0 = time.perf_counter()
    try:
        module = load(
            name="vision_serve_int8_linear",
            sources=[str(INT8_SOURCE)],
            extra_cflags=INT8_FLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:
        log.warning("int8 kernel unavailable, dequantizing with PyTorch: %s", exc)
        return None
    log.info("int8 kernel ready in %.1f s", time.perf_counter() - t0)
    return module


def variants_not_loaded() -> list[str]:
    """Kernel variants this machine does not build at start."""
    return [v for v in VARIANTS if v != cpu_variant()]


def compile_check(
    compiler: str = "g++", variants: list[str] | None = None
) -> dict[str, str | None]:
    """Compile every variant's sources to object code, without loading them.

    A machine runs one variant at most, yet CI on any machine must show
    that all of them build: the compiler targets the instruction set named by the flags, not
    the CPU it runs on. Returns variant/source -> None when it compiled, else the error.
    """
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    jobs = {
        f"{variant}/{src.name}": [
            compiler,
            "-std=c++20",
            "-fPIC",
            "-O0",
            *_FLAGS,
            *extra,
            *includes,
            f"-I{Path(__file__).parent}",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-DTORCH_EXTENSION_NAME=compile_check",
            "-DTORCH_API_INCLUDE_EXTENSION_H",
            "-c",
            str(src),
            "-o",
            os.devnull,
        ]
        for variant, extra in VARIANTS.items()
        if variants is None or variant in variants
        for src in _SOURCES
    }

    def run(cmd: list[str]) -> str | None:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        return None if proc.returncode == 0 else proc.stderr[-4000:]

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = dict(zip(jobs, pool.map(run, jobs.values()), strict=True))
    return results
