"""Machine limits measured in the same run as a benchmark: matmul peak and memory bandwidth.

Ratios against these (MFU, bandwidth utilisation) say how close to the machine we run,
independent of which CPU or GPU the numbers came from.
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str = "cpu") -> None:
    """GPU work is asynchronous: a timer read before it finishes measures the launch only."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _best_time(fn, repeats: int, device: torch.device | str = "cpu") -> float:
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_peak_flops(
    dtype: torch.dtype, n: int = 2048, repeats: int = 5, device: torch.device | str = "cpu"
) -> float:
    """FLOP/s of a large square matmul: the practical compute roof for this dtype. For bf16 on
    a CPU without bf16 arithmetic it is the better of bf16 (emulated) and fp32: the engine
    widens bf16 weights to fp32 for large products there, so the fp32 rate is its roof."""
    if torch.device(device).type == "cuda":
        n = max(n, 8192)  # a 2048 product leaves most of a big GPU idle
    emulated = False
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        from engine.device import cpu_has_fast_bf16

        # emulated bf16 runs at 1-60 GFLOP/s (1.4 on an AVX2-only EPYC): a 2048 product would
        # take a minute there, and the fp32 rate is the roof anyway
        emulated = not cpu_has_fast_bf16()
        if emulated:
            n = min(n, 512)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    rate = 2 * n**3 / _best_time(lambda: a @ b, repeats, device)
    if emulated:
        rate = max(rate, matmul_peak_flops(torch.float32, repeats=repeats))
    return rate


def memory_bandwidth(
    num_bytes: int = 1 << 30, repeats: int = 5, device: torch.device | str = "cpu"
) -> float:
    """Read bandwidth (bytes/s): the best of a few streaming reads over a buffer far larger
    than cache. The best is the honest roof: a utilisation against a slow probe would flatter
    the engine. Where the engine's CPU kernels run, the buffer is read again from huge pages
    (as the kernels hold their weights), also by the kernels' own bf16 GEMV: on this machine
    those read faster than torch's reductions over regular pages. On a GPU: a reduction over
    its memory."""
    if torch.device(device).type == "cuda":
        x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
        return num_bytes / _best_time(lambda: x.sum(), repeats, device)
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    probes = [lambda: x.max(), lambda: x.sum(), lambda: torch.dot(x, x)]
    from engine.kernels import load_cpu_decode

    kernels = load_cpu_decode()
    if kernels is not None:
        (xh,) = kernels.copy_to_huge_pages([x])
        del x
        cols = 4096
        (w,) = kernels.copy_to_huge_pages([torch.ones(num_bytes // 2 // cols, cols).bfloat16()])
        v = torch.ones(1, cols, dtype=torch.bfloat16)
        probes = [lambda: xh.max(), lambda: xh.sum(), lambda: kernels.small_matmul(v, w)]
    return max(num_bytes / _best_time(p, repeats) for p in probes)


def measure(device: str = "cpu") -> dict[str, float]:
    return {
        "matmul_peak_fp32_gflops": matmul_peak_flops(torch.float32) / 1e9,
        "matmul_peak_bf16_gflops": matmul_peak_flops(torch.bfloat16) / 1e9,
        "mem_bandwidth_gbs": memory_bandwidth() / 1e9,
        "threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    for k, v in measure().items():
        print(f"{k}: {v:.1f}")
