"""Native CPU kernels: prebuilt, or compiled on first use with the machine's C++ compiler.

The fused decode step (``cpu_decode.cpp``) and the fused prefill attention
(``cpu_attention.cpp``) are optional: without a compiler, on a CPU with neither AVX-512 nor
AVX2, or when the build fails, :func:`load_cpu_decode` returns ``None`` and the engine runs its
eager PyTorch path, which gives the same tokens up to bf16 rounding.

The kernels are written once against a small vector vocabulary (``isa.h``) with one traits
header per instruction set (``isa/``), and built per variant (:data:`VARIANTS`): CPUs with
AVX512-BF16 get the bf16 dot-product instruction; plain AVX-512 CPUs (Skylake-X, Ice Lake) and
AVX2 CPUs (Haswell+, Zen 1-3, N100) a build that widens bf16 to fp32 in registers: there bf16
matmuls in oneDNN are emulated too, and the kernels matter most. Each variant is its own
module (``build.py`` compiles and finds them). A module is imported from
``$VISION_SERVE_KERNELS_DIR`` when that holds one stamped for these sources, flags, torch and
Python (the Docker image carries every variant there, read-only: ``python -m engine.kernels
--prebuild DIR``); otherwise it is compiled once into ``$TORCH_EXTENSIONS_DIR/vision_serve``
(default ``~/.cache/torch_extensions/vision_serve``; a home directory shared across CPUs keeps
all of them) and reused until its inputs change. ``python -m engine.kernels`` readies this
CPU's ahead of time.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import torch

from engine.kernels import build

log = logging.getLogger("engine.kernels")

_DIR = Path(__file__).parent
_SOURCES = (_DIR / "cpu_decode.cpp", _DIR / "cpu_attention.cpp")
_HEADERS = (
    _DIR / "isa.h",
    _DIR / "chunk_attention.h",
    _DIR / "amx_gemv.h",
    _DIR / "amx_attention.h",
    *sorted((_DIR / "isa").glob("*.h")),
)
_FLAGS = ["-O3", "-fopenmp"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
# variant -> the instruction-set flags that select its traits header (isa.h)
VARIANTS = {
    # every AVX512-BF16 CPU also has AVX512-VNNI (the int8 panels' integer dot products)
    "native-bf16": [*_AVX512, "-mavx512bf16", "-mavx512vnni"],
    # AVX-512 without bf16 arithmetic: with VNNI (Ice Lake, Cascade Lake: the int8 panels'
    # int8 dot product) and without (Skylake-SP/X: int8 weights widened to fp32)
    "emulated-bf16-vnni": [*_AVX512, "-mavx512vnni"],
    "emulated-bf16": _AVX512,
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
_MODULES = {
    "native-bf16": "vision_serve_cpu_decode",
    "emulated-bf16-vnni": "vision_serve_cpu_decode_bf16_emulated_vnni",
    "emulated-bf16": "vision_serve_cpu_decode_bf16_emulated",
    "avx2": "vision_serve_cpu_decode_avx2",
}
DISABLE_ENV = "VISION_SERVE_DISABLE_CPU_KERNELS"
# a variant this CPU can run, chosen over its best one: runs a lesser build's code paths (the
# AVX2 kernels on an AVX-512 machine) in tests and benchmarks
VARIANT_ENV = "VISION_SERVE_CPU_VARIANT"
PREBUILT_ENV = "VISION_SERVE_KERNELS_DIR"
INT8_MODULE = "vision_serve_int8_linear"
INT8_SOURCE = _DIR / "int8_linear.cpp"
INT8_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")


def decode_extension(variant: str) -> build.Extension:
    """The fused decode step and flash attention, built for ``variant`` (a key of VARIANTS)."""
    return build.Extension(
        name=_MODULES[variant],
        sources=_SOURCES,
        headers=_HEADERS,
        cflags=(*_FLAGS, *VARIANTS[variant]),
        ldflags=("-fopenmp",),
    )


def int8_extension() -> build.Extension:
    """The weight-only int8 GEMV: AVX2+FMA, so one build runs on every variant's CPU."""
    return build.Extension(
        name=INT8_MODULE,
        sources=(INT8_SOURCE,),
        headers=_HEADERS,
        cflags=INT8_FLAGS,
        ldflags=("-fopenmp",),
    )


def extensions(variant: str) -> list[build.Extension]:
    """Every module a CPU of ``variant`` imports."""
    return [decode_extension(variant), int8_extension()]


def sources_digest(variant: str) -> str:
    """A digest of what ``variant``'s decode module is compiled from: anything measured on
    its kernels (a step-cost calibration) is stale once it changes."""
    return build.sources_digest(decode_extension(variant))


def prebuilt_dir() -> Path | None:
    """``$VISION_SERVE_KERNELS_DIR``: modules built ahead (read only), or ``None``."""
    value = os.environ.get(PREBUILT_ENV, "").strip()
    return Path(value) if value else None


def cache_dir() -> Path:
    """Where a module missing from :func:`prebuilt_dir` is compiled: writable, kept."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR", "").strip()
    base = Path(root) if root else Path.home() / ".cache" / "torch_extensions"
    return base / "vision_serve"


def prebuild(out_dir: Path, variants: list[str] | None = None) -> dict[str, str | None]:
    """Build every variant's modules (default: all of :data:`VARIANTS`) into ``out_dir``
    without importing any: the build host need not run the instruction sets it builds for.
    Returns module name -> ``None`` when built, else the error."""
    chosen = list(VARIANTS) if variants is None else variants
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown kernel variant(s) {unknown}; known: {sorted(VARIANTS)}")
    exts = {ext.name: ext for variant in chosen for ext in extensions(variant)}
    # objects this machine's build cache already holds (its own variant's, compiled at setup,
    # kept keyed by command and inputs) are linked, not compiled again: CI's prebuild then
    # compiles only the variants this CPU does not run. A fresh host (the image build) has none
    reuse = cache_dir() / "obj"
    return build.build_all(list(exts.values()), out_dir, obj_dir=reuse if reuse.is_dir() else None)


def _load(ext: build.Extension) -> ModuleType:
    return build.load(ext, prebuilt_dir(), cache_dir())


@functools.cache
def _cpu_probe(name: str) -> bool:
    """``torch.cpu._is_*_supported``: private, and no public API tells AVX512-BF16 (see
    tests/engine/test_torch_private_ops.py, which pins them). A torch without the probe
    reads as a CPU without the feature (eager path), said once in the log."""
    probe = getattr(torch.cpu, name, None)
    if probe is None:
        log.warning(
            "torch.cpu.%s is missing (torch %s): treated as unsupported", name, torch.__version__
        )
        return False
    try:
        return bool(probe())
    except Exception as exc:
        log.warning("torch.cpu.%s failed (%s): treated as unsupported", name, exc)
        return False


def cpu_supports_avx512_bf16() -> bool:
    return _cpu_probe("_is_avx512_bf16_supported")


def cpu_supports_avx512_vnni() -> bool:
    return _cpu_probe("_is_vnni_supported")


def cpu_supports_avx512() -> bool:
    """AVX-512 F/BW/VL/DQ, as PyTorch's own AVX512 kernels require."""
    return _cpu_probe("_is_avx512_supported")


def cpu_supports_avx2() -> bool:
    """AVX2 as PyTorch's own AVX2 kernels require it (with FMA); every such CPU has F16C."""
    return _cpu_probe("_is_avx2_supported")


def runnable_variants() -> list[str]:
    """The kernel variants this CPU can run (keys of :data:`VARIANTS`), best first."""
    out = []
    if cpu_supports_avx512():
        if cpu_supports_avx512_vnni():
            if cpu_supports_avx512_bf16():
                out.append("native-bf16")
            out.append("emulated-bf16-vnni")
        out.append("emulated-bf16")
    if cpu_supports_avx2():
        out.append("avx2")
    return out


def cpu_variant() -> str | None:
    """The kernel variant this CPU runs (a key of :data:`VARIANTS`): its best, or the one
    ``VISION_SERVE_CPU_VARIANT`` names where the CPU can run it; ``None`` without one."""
    forced = forced_variant()
    if forced is not None:
        return forced
    runnable = runnable_variants()
    return runnable[0] if runnable else None


def forced_variant() -> str | None:
    """The variant ``VISION_SERVE_CPU_VARIANT`` names, where this CPU runs it (else ``None``,
    said once in the log). The engine then plans as a CPU of that class would
    (:func:`engine.device.cpu_has_fast_bf16`): a lesser variant's kernels beside bf16
    arithmetic the CPUs it is built for lack would be a plan no machine runs."""
    forced = os.environ.get(VARIANT_ENV, "")
    if not forced:
        return None
    runnable = runnable_variants()
    if forced in runnable:
        return forced
    _warn_once(f"{VARIANT_ENV}={forced} ignored: this CPU runs {runnable or 'none'}")
    return None


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)


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
    t0 = time.perf_counter()
    try:
        module = _load(decode_extension(variant))
    except Exception as exc:
        log.warning("cpu kernels unavailable, using the eager path: %s", exc)
        return None
    log.info(
        "cpu kernels ready in %.1f s (variant %s: bf16 dot products %s; %s)",
        time.perf_counter() - t0,
        variant,
        "native" if module.bf16_dot else "emulated",
        module.__file__,
    )
    return module


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
    t0 = time.perf_counter()
    try:
        module = _load(int8_extension())
    except Exception as exc:
        log.warning("int8 kernel unavailable, dequantizing with PyTorch: %s", exc)
        return None
    log.info("int8 kernel ready in %.1f s (%s)", time.perf_counter() - t0, module.__file__)
    return module


def variants_not_loaded() -> list[str]:
    """Kernel variants this machine does not build at start."""
    return [v for v in VARIANTS if v != cpu_variant()]


def compile_check(
    compiler: str | None = None, variants: list[str] | None = None
) -> dict[str, str | None]:
    """Compile every variant's sources to object code (at -O0, into /dev/null), loading none.

    A machine runs one variant at most, yet CI on any machine must show that all of them
    build: the compiler targets the instruction set named by the flags, not the CPU it runs
    on. The commands are the build's (``build.compile_command``) with ``-O0`` last, so only
    the optimiser's time is saved. Returns variant/source -> None when it compiled, else the
    error.
    """
    jobs = {}
    for variant in VARIANTS if variants is None else variants:
        ext = decode_extension(variant)
        for src in ext.sources:
            cmd = build.compile_command(
                ext, src, os.devnull, module_name="compile_check", extra=("-O0",)
            )
            jobs[f"{variant}/{src.name}"] = [compiler or cmd[0], *cmd[1:]]

    def run(cmd: list[str]) -> str | None:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            return f"{cmd[0]}: {exc}"
        return None if proc.returncode == 0 else proc.stderr[-4000:]

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = dict(zip(jobs, pool.map(run, jobs.values()), strict=True))
    return results
