"""The fused kernel's GEMVs alone: ms and GFLOP/s per row count over a decoder's matrices.

Runs every matrix of a ``bench``-shaped decoder (12 layers of q, k, v, o, gate, up, down; no
lm_head) through the kernel's three weight paths, best of ``--repeats`` passes each:
``bf16-panel`` (the emulated builds' panels), ``int8-panel`` (weight-only int8) and
``bf16-rowmajor`` (the dot-product kernel the engine uses below the panels' row threshold).
Which path wins at which row count is what ``kPanelRows`` and the panel blocks in
``engine/kernels/cpu_decode.cpp`` encode; run it after changing either.

    python -m benchmarks.gemv [--rows 1 4 8 16] [--repeats 15]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import log, save_json, setup_env


def layer_shapes(preset: str = "bench") -> list[tuple[int, int]]:
    """[N, K] of one decoder layer's matrices (q, k, v, o, gate, up, down) of a preset."""
    from engine.checkpoints import PRESET_SHAPES

    p = PRESET_SHAPES[preset]
    h, kv = p.hidden_size, p.hidden_size // p.num_heads * p.num_kv_heads
    i = p.intermediate_size
    return [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="gemv.json")
    args = ap.parse_args()

    from engine.kernels import load_cpu_decode
    from engine.layers.quantized import quantize_int8

    ext = load_cpu_decode()
    if ext is None:
        raise SystemExit("the CPU kernels do not build here (needs AVX2 or AVX-512)")
    if ext.bf16_dot:
        raise SystemExit("this build multiplies bf16 natively: it has no bf16 panels to time")
    torch.manual_seed(0)
    shapes = layer_shapes() * args.layers
    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in shapes]
    params = sum(n * k for n, k in shapes)
    paths = {
        "bf16-panel": [ext.PanelGemv(w) for w in weights],
        "int8-panel": [ext.PanelGemv(*quantize_int8(w)) for w in weights],
        "bf16-rowmajor": None,
    }
    log(f"{ext.isa} build, {torch.get_num_threads()} threads, {params / 1e6:.1f} M weights")
    results: dict[str, dict[str, float]] = {}
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, k in shapes}}
        row = {}
        for name, gemvs in paths.items():
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                if gemvs is None:
                    for w in weights:
                        ext.small_matmul(xs[w.shape[1]], w)
                else:
                    for g, (_, k) in zip(gemvs, shapes, strict=True):
                        g.forward(xs[k])
                best = min(best, time.perf_counter() - t0)
            row[name] = best * 1e3
        results[str(m)] = row
        cells = [
            f"{n} {ms:6.1f} ms {2 * params * m / ms / 1e6:6.1f} GFLOP/s" for n, ms in row.items()
        ]
        log(f"rows {m:2d}: " + " | ".join(cells))
    save_json(args.out, {"isa": ext.isa, "threads": torch.get_num_threads(), "ms": results})


if __name__ == "__main__":
    main()
