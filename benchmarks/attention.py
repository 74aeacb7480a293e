"""The flash kernel's attention per call: dot products against AMX tiles, and torch's SDPA.

Shapes the engine calls it with on the ``bench`` checkpoint: a camera prompt's chunk against
its earlier keys (12 heads of 64, 4 KV heads; causal) and a vision-tower piece against a
640x480 frame's 4,800 keys (6 heads of 64; full attention), cut as the scheduler cuts them
(rows of all heads, or one head's rows); plus Qwen2-VL-2B's head size (128). Each variant
runs in turns, the median of ``--repeats`` calls kept. ``amx`` appears only where the CPU and
the OS grant AMX (``engine.kernels.amx_usable``).

    python -m benchmarks.attention [--repeats 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import log, save_json, setup_env

# (name, query rows, keys, query heads, KV heads, head size, causal)
SHAPES = (
    ("prompt chunk 16 x 1200", 16, 1200, 12, 4, 64, True),
    ("prompt chunk 128 x 1200", 128, 1200, 12, 4, 64, True),
    ("prompt chunk 256 x 1200", 256, 1200, 12, 4, 64, True),
    ("vision piece 43 rows x 6 heads", 43, 4800, 6, 6, 64, False),
    ("vision piece 256 rows x 1 head", 256, 4800, 1, 1, 64, False),
    ("vision piece 512 rows x 6 heads", 512, 4800, 6, 6, 64, False),
    ("2B chunk 128 x 1200, head 128", 128, 1200, 12, 2, 128, True),
)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def kernel_call(kernels, q, k, v, causal: bool, amx: bool):
    """The kernel as the engine calls it: keys and values packed once, then attended."""
    packed = kernels.pack_kv(k, v)
    scale = q.shape[2] ** -0.5
    return lambda: kernels.attend_packed(q, packed, scale, causal, amx)


def sdpa_call(q, k, v, causal: bool):
    """torch's SDPA as the eager path would call it: heads first, KV heads repeated, the
    chunk's causal offset as a mask (the queries are the last of the keys)."""
    n, m, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1)
    kt = k.repeat_interleave(group, 1).transpose(0, 1)
    vt = v.repeat_interleave(group, 1).transpose(0, 1)
    mask = torch.ones(n, m, dtype=torch.bool).tril(m - n) if causal else None
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set up)")
    ap.add_argument("--out", default="attention.json")
    args = ap.parse_args()
    from engine.kernels import load_cpu_decode

    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_decode()
    if kernels is None:
        raise SystemExit("engine.kernels do not build on this CPU: nothing to compare")
    amx = bool(kernels.amx_usable())
    rows = []
    for name, n, m, heads, kv_heads, head_dim, causal in SHAPES:
        gen = torch.Generator().manual_seed(n + m)
        q = torch.randn(n, heads, head_dim, generator=gen).bfloat16()
        k = torch.randn(m, kv_heads, head_dim, generator=gen).bfloat16()
        v = torch.randn(m, kv_heads, head_dim, generator=gen).bfloat16()
        variants = {"dot": kernel_call(kernels, q, k, v, causal, False)}
        variants["sdpa"] = sdpa_call(q, k, v, causal)
        if amx:
            variants["amx"] = kernel_call(kernels, q, k, v, causal, True)
        ms = {key: median_ms(fn, args.repeats) for key, fn in variants.items()}
        pairs = n * m if not causal else n * (m - n) + n * (n + 1) / 2
        gflop = 4 * pairs * heads * head_dim / 1e9
        row = {"shape": name, "ms": ms, "gflops": {k: gflop / (t / 1e3) for k, t in ms.items()}}
        rows.append(row)
        log(
            f"{name}: "
            + ", ".join(f"{k} {t:.2f} ms ({row['gflops'][k]:.0f} GFLOP/s)" for k, t in ms.items())
        )
    save_json(
        args.out,
        {"amx": amx, "threads": torch.get_num_threads(), "isa": kernels.isa, "rows": rows},
    )


if __name__ == "__main__":
    main()
