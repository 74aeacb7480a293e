"""One OpenMP team in a server process: the step loop's; every other thread runs torch serially.

libgomp (the OpenMP runtime torch's CPU ops run on) keeps an idle team of worker threads for
every thread that ever ran a parallel region. Once those teams hold more threads than the
process has CPUs, *every* team's threads give up spinning after ~100 polls and sleep on a
futex at each barrier (libgomp's "throttled" spin count): a small parallel op then took 53-58
µs against 26-30 (``python -m benchmarks.openmp_teams``). In the server the model is built (and
calibrated) on the main thread and preprocessing threads run torch ops on images, so on a
2-core machine the step thread slept ~24 times a decode step with the bench checkpoint (~14 with
the tiny one); the offline ``LLM``, one thread running everything, never did. Releasing the
builder thread's team and keeping the other threads serial: ~0.05 sleeps a step. What that buys
a step moved less than this machine's minute-to-minute noise (benchmarks/README, session 29),
but it undid the reason encoder pieces beside chat ran on one thread fewer (a thread the front
end preempted held up the other, asleep at the barrier): on every thread they ran 23-40 % less
per unit of work beside chat there, and the chat ITL was no worse. The cost: a spinning team
pays in full for a partner the OS preempts. In one run of issue 14's workload, of ~19,000
steps with chat decodes 166 ran over 40 ms (537 with the old code) but 6 over 100 ms (2),
3 of them spinning at barriers (73-76 ms of CPU in 109-136 ms steps).

Both levers are per thread: ``omp_set_num_threads`` sets only the calling thread's count, and
``omp_pause_resource_all`` frees only the calling thread's team. torch reads the count per
thread too (``torch.get_num_threads`` is ``omp_get_max_threads``); MKL's matmuls take their
own count, process-wide unless a thread sets its local one, which :func:`serial_thread` does.
Where torch runs on another runtime (no libgomp or libomp in the process: macOS, an ARM build
with its own pool), each call is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger("engine.openmp")

# the OpenMP runtimes a torch build links, and where MKL's symbols are (linked statically into
# libtorch_cpu by the x86 wheels)
OPENMP_RUNTIMES = ("libgomp", "libomp", "libiomp5")
MKL_LIBRARIES = ("libmkl_rt", "libmkl_gnu_thread", "libtorch_cpu")
OMP_PAUSE_SOFT = 1


def _mapped_libraries() -> list[str]:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return sorted({line.split()[-1] for line in maps if ".so" in line})
    except OSError:  # not Linux
        return []


def _open_mapped(prefixes: tuple[str, ...], symbol: str) -> ctypes.CDLL | None:
    """The first mapped library, by prefix order, that exports ``symbol``: the copy torch
    loaded (a wheel bundles its own under a hashed name; loading one by name could load a
    second)."""
    torch.get_num_threads()  # torch's runtime is mapped once torch has started it
    paths = _mapped_libraries()
    for prefix in prefixes:
        for path in paths:
            if path.rsplit("/", 1)[-1].startswith(prefix):
                try:
                    lib = ctypes.CDLL(path)
                except OSError as exc:
                    log.debug("could not open %s: %s", path, exc)
                    continue
                if hasattr(lib, symbol):
                    return lib
    return None


@functools.cache
def runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's CPU ops run on, or None."""
    return _open_mapped(OPENMP_RUNTIMES, "omp_set_num_threads")


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    """MKL, where torch has it: its matmuls size their teams by MKL's own (process-wide)
    count, which ``torch.set_num_threads`` sets, unless a thread sets its local one."""
    return _open_mapped(MKL_LIBRARIES, "MKL_Set_Num_Threads_Local")


def serial_thread() -> None:
    """Run this thread's torch ops on this thread alone, with no team of its own: for helper
    threads (preprocessing, the server's I/O pool) so the step loop's team is the only one.
    Meant as a ``ThreadPoolExecutor`` initializer or a thread's first call: it never raises
    (an initializer that raised would break its pool, every later request with it)."""
    try:
        lib = runtime()
        if lib is None:
            return
        torch.get_num_threads()  # torch sets each thread's count at its first op: do that first
        lib.omp_set_num_threads(1)
        mkl = _mkl()
        if mkl is not None:
            mkl.MKL_Set_Num_Threads_Local(1)  # the C entry point (lower-case is Fortran's)
    except Exception as exc:  # a speed setting is never worth a broken pool
        log.warning("could not make this thread's torch ops serial: %s", exc)


def release_team() -> None:
    """Let go of the idle worker threads this thread's parallel regions left (the thread that
    built and calibrated an engine before handing it to a step loop). The thread may still
    run parallel torch ops later; its next one starts a new team."""
    lib = runtime()
    if lib is None or not hasattr(lib, "omp_pause_resource_all"):
        return
    if lib.omp_pause_resource_all(OMP_PAUSE_SOFT) != 0:  # refused inside a parallel region
        log.debug("the OpenMP runtime kept this thread's team")
