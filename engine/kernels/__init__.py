"""Native CPU kernels, compiled on first use with the machine's C++ compiler.

The fused decode step (``cpu_decode.cpp``) and the fused prefill attention
(``cpu_attention.cpp``) are optional: without a compiler, on a CPU without
AVX512-BF16, or when the build fails, :func:`load_cpu_decode` returns ``None`` and the engine
runs its eager PyTorch path, which gives the same tokens up to bf16 rounding. The build is
cached by PyTorch under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and
reused until the source changes; ``python -m engine.kernels`` builds it ahead of time.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("engine.kernels")

_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_decode.cpp", "cpu_attention.cpp")]
_HEADERS = [Path(__file__).with_name("simd.h")]
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]
DISABLE_ENV = "VISION_SERVE_DISABLE_CPU_KERNELS"


def cpu_supports_avx512_bf16() -> bool:
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    try:
        return bool(probe and probe())
    except Exception:
        return False


@functools.cache
def load_cpu_decode() -> ModuleType | None:
    """The compiled fused-decode module, or ``None`` where it cannot run (reason logged)."""
    if os.environ.get(DISABLE_ENV, "").lower() in ("1", "true", "yes"):
        log.info("cpu kernels disabled by %s", DISABLE_ENV)
        return None
    if not cpu_supports_avx512_bf16():
        log.info("cpu kernels skipped: this CPU has no AVX512-BF16")
        return None
    from torch.utils.cpp_extension import load

    # PyTorch rebuilds when the sources or flags change, not the headers: their hash goes in
    # as a flag
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in _HEADERS)).hexdigest()[:16]
    t0 = time.perf_counter()
    try:
        module = load(
            name="vision_serve_cpu_decode",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=[*_FLAGS, f"-DVS_HEADERS_{headers}"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:
        log.warning("cpu kernels unavailable, using the eager path: %s", exc)
        return None
    log.info("cpu kernels ready in %.1f s", time.perf_counter() - t0)
    return module
