"""Freed host memory handed back to the OS once the model is laid out.

Loading lays the decoder's weights out several times (safetensors into parameters, huge pages,
oneDNN's packing, the fused decoder's panels) and frees what it no longer needs. glibc keeps
freed blocks under its mmap threshold (which the first large free raises to as much as 32 MiB)
in its heap for later allocations: the process stays at its peak resident size. On the bench
checkpoint (Zen 4) the fused decoder letting its row-major copy go lowered the resident size
by 190 MiB with a trim, by 35-80 MiB without one (two scratch runs; ``python -m
benchmarks.load_memory`` measures the former).
"""

from __future__ import annotations

import ctypes


def resident_mib() -> float:
    """This process's resident set size, MiB (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / (1 << 20)
    except (OSError, ValueError, IndexError):
        return 0.0


def trim_heap() -> bool:
    """Returns glibc's free heap pages to the OS; False where the C library has no
    ``malloc_trim`` (musl, macOS) or nothing was released."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))
