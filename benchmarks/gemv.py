"""The fused kernel's GEMVs alone: ms and GFLOP/s per row count over a decoder's matrices.

Runs every matrix of a ``bench``-shaped decoder (12 layers of q, k, v, o, gate, up, down) and,
with ``--lm-head``, its lm_head through each weight path this build and CPU have, best of
``--repeats`` passes each: ``bf16-panel`` (bf16 panels: widened in the emulated builds, the
bf16 dot product in the native one), ``int8-panel`` (weight-only int8), ``bf16-rowmajor`` (the
kernel the engine uses below the panels' row threshold, 1-16 rows), and on AMX CPUs
``int8-tile`` / ``bf16-tile`` (the AMX-INT8 and AMX-BF16 tiles of
``engine/kernels/amx_gemv.h``; bf16 tiles 1-16 rows). Which
path wins at which row count is what ``kPanelRows``, ``kI8TileRows`` and the panel blocks in
``engine/kernels/cpu_decode.cpp`` encode; run it after changing either. Paths are timed in
turns, pass by pass (the machines here move 20-40 % between minutes).

    python -m benchmarks.gemv [--rows 1 4 8 16] [--repeats 15] [--lm-head]
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
    ap.add_argument("--lm-head", action="store_true", help="the bench lm_head too")
    ap.add_argument("--out", default="gemv.json")
    args = ap.parse_args()

    from engine.kernels import load_cpu_decode
    from engine.layers.quantized import quantize_int8

    ext = load_cpu_decode()
    if ext is None:
        raise SystemExit("the CPU kernels do not build here (needs AVX2 or AVX-512)")
    torch.manual_seed(0)
    shapes = layer_shapes() * args.layers
    if args.lm_head:
        from engine.checkpoints import PRESET_SHAPES

        p = PRESET_SHAPES["bench"]
        shapes.append((p.vocab_size, p.hidden_size))
    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in shapes]
    int8 = [quantize_int8(w) for w in weights]
    params = sum(n * k for n, k in shapes)
    paths: dict[str, tuple[object, int]] = {}  # name -> (forward over all matrices, most rows)
    paths["bf16-panel"] = (ext.PanelGemv, weights, 1 << 30)
    paths["int8-panel"] = (ext.PanelGemv, int8, 1 << 30)
    if getattr(ext, "amx_int8_usable", lambda: False)():
        paths["int8-tile"] = (ext.TileGemv, int8, 1 << 30)
    if ext.amx_usable():
        paths["bf16-tile"] = (ext.TileGemv, weights, 16)
    gemvs = {
        name: ([make(*w) if isinstance(w, tuple) else make(w) for w in ws], most)
        for name, (make, ws, most) in paths.items()
    }
    log(
        f"{ext.isa} build, {torch.get_num_threads()} threads, {params / 1e6:.1f} M weights; "
        f"paths: {', '.join([*gemvs, 'bf16-rowmajor'])}"
    )
    results: dict[str, dict[str, float]] = {}
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, k in shapes}}
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, (gs, most) in gemvs.items():
                if m > most:
                    continue
                t0 = time.perf_counter()
                for g, (_, k) in zip(gs, shapes, strict=True):
                    g.forward(xs[k])
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
            if m <= 16:
                t0 = time.perf_counter()
                for w in weights:
                    ext.small_matmul(xs[w.shape[1]], w)
                best["bf16-rowmajor"] = min(
                    best.get("bf16-rowmajor", float("inf")), time.perf_counter() - t0
                )
        row = {name: sec * 1e3 for name, sec in best.items()}
        results[str(m)] = row
        cells = [
            f"{n} {ms:6.2f} ms {2 * params * m / ms / 1e6:6.1f} GFLOP/s" for n, ms in row.items()
        ]
        log(f"rows {m:2d}: " + " | ".join(cells))
    save_json(args.out, {"isa": ext.isa, "threads": torch.get_num_threads(), "ms": results})


if __name__ == "__main__":
    main()
