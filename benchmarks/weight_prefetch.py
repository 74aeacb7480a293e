"""The native GEMV's software weight prefetch, row limit and kind, in turns inside one engine:
decode step time per batch size, prefetch distance, ``gemv_max_rows`` (past it a decode step
runs oneDNN's packed GEMM) and, on AMX CPUs, dot products against AMX tiles
(``engine/kernels/amx_gemv.h``; the tiles prefetch their own way, so they run once per row
limit, at no distance of this script's).

Why in one process: the machines here move 20-40 % between minutes, more than the effect; the
distance is a setting of the fused decoder (``FusedDecoder.set_weight_prefetch``), so each
round runs every distance back to back on the same engine, order reversed every round, and the
medians are compared. The platform plan (``engine/platform.py``) prefetches 4 KiB ahead on
Intel and Zen 5 native-bf16 builds and not at all elsewhere, and sends up to 16 rows (Intel),
12 (Zen 5) or 4 to the GEMV; run
this on a new CPU class to check those choices (``--gemv-rows 4 16``: each limit rebuilds the
fused decoder, which shares the engine's weights). Kind ``panels`` runs 1-row steps on the
bf16 panels too, with the decoder's row-major copy let go (``FusedDecoder.drop_row_major``; the
plan does so where ``gemv_row_major_needed`` says, plan line ``gemv_1_row``): against ``dot``
it says whether a CPU class needs that copy. The engine is loaded with the copy kept, whatever
the plan, so that every kind can run.
The emulated builds prefetch by compilation and are not affected (the script says so).

    python -m benchmarks.weight_prefetch [--batches 1 4 8] [--distances 0 2048 4096 8192]
        [--gemv-rows 4 16] [--kinds dot panels amx-tiles]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import bench_checkpoint, checkpoint_args, log, save_json, setup_env


def median_decode_step(engine, tag: str, batch: int, steps: int) -> float:
    """Median seconds of the decode-only steps of ``batch`` fresh 64-token prompts."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"{tag}-{b}", {"prompt_token_ids": list(range(100, 164))}, params)
    engine.step()  # the prompts
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(description=__doc__)
    checkpoint_args(ap, dtype="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--distances", type=int, nargs="+", default=[0, 2048, 4096, 8192])
    ap.add_argument(
        "--gemv-rows", type=int, nargs="+", default=None,
        help="GEMV row limits to try (default: the plan's only)",
    )  # fmt: skip
    ap.add_argument(
        "--kinds", nargs="+", choices=["dot", "panels", "amx-tiles"], default=None,
        help="GEMV kinds to try (default: dot and panels, and amx-tiles where AMX runs)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=48, help="decode steps per measurement")
    ap.add_argument("--out", default="weight_prefetch.json")
    args = ap.parse_args()

    import engine.platform as platform
    from engine.config import EngineArgs
    from engine.kernels import load_cpu_decode
    from engine.llm_engine import LLMEngine

    kernels = load_cpu_decode()
    row_major_needed = platform.gemv_row_major_needed
    platform.gemv_row_major_needed = lambda prefetch_bytes, amx_tiles: True  # every kind runs
    try:
        engine = LLMEngine(
            EngineArgs(model=str(bench_checkpoint(args.family, args.model)), dtype=args.dtype)
        )
    finally:
        platform.gemv_row_major_needed = row_major_needed
    if kernels is None or not kernels.bf16_dot or engine.runner.fused_decoder is None:
        log("no native-bf16 fused decoder on this machine: its prefetch is compiled in or absent")
        save_json(args.out, {"skipped": True, "args": vars(args)})
        return
    runner = engine.runner
    plan_distance, plan_rows = runner.weight_prefetch_bytes, runner.gemv_max_rows
    plan_tiles = runner.gemv_amx_tiles
    row_limits = args.gemv_rows or [plan_rows]
    kinds = args.kinds or ["dot", "panels"] + (["amx-tiles"] if kernels.amx_usable() else [])
    if "amx-tiles" in kinds and not kernels.amx_usable():
        raise SystemExit("--kinds amx-tiles: this CPU or OS runs no AMX")
    decoders = {}
    for rows in row_limits:  # one fused decoder per limit, built once, swapped in turns
        runner.gemv_max_rows = rows
        decoders[rows] = runner._build_fused_decoder()
        if "panels" in kinds:  # one more, its row-major copy gone: panels from 1 row
            decoders[rows, "panels"] = runner._build_fused_decoder()
            if not decoders[rows, "panels"].drop_row_major():
                raise SystemExit("--kinds panels: this decoder keeps its row-major copy")
    runner.gemv_amx_tiles = False  # each variant sets its own kind
    variants: list[tuple[int, int, str]] = []
    if "dot" in kinds:
        variants += [(rows, d, "dot") for rows in row_limits for d in args.distances]
    if "panels" in kinds:  # the panels' own prefetch: no distance of this script's
        variants += [(rows, plan_distance, "panels") for rows in row_limits]
    if "amx-tiles" in kinds:  # the tiles' own prefetch: no distance of this script's
        variants += [(rows, plan_distance, "amx-tiles") for rows in row_limits]
    median_decode_step(engine, "warm", 1, 4)
    results: dict[int, dict[str, list[float]]] = {
        b: {variant_name(*v): [] for v in variants} for b in args.batches
    }
    try:
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for batch in args.batches:
                for rows, distance, kind in order:
                    decoder = decoders[(rows, "panels") if kind == "panels" else rows]
                    runner.fused_decoder = decoder
                    decoder.set_weight_prefetch(distance)
                    decoder.set_amx_gemv(kind == "amx-tiles")
                    tag = f"{r}-{batch}-{rows}-{distance}-{kind}"
                    step = median_decode_step(engine, tag, batch, args.steps)
                    results[batch][variant_name(rows, distance, kind)].append(step)
    finally:
        runner.gemv_max_rows, runner.gemv_amx_tiles = plan_rows, plan_tiles
        runner.fused_decoder = decoders.get(plan_rows)
        if runner.fused_decoder is not None:
            runner.fused_decoder.set_amx_gemv(plan_tiles)
    summary = {
        batch: {name: 1e3 * statistics.median(v) for name, v in per.items()}
        for batch, per in results.items()
    }
    for batch, per in summary.items():
        row = "  ".join(f"{name}: {ms:.2f} ms" for name, ms in per.items())
        log(f"batch {batch}: {row}")
    plan_kind = (
        "amx-tiles"
        if plan_tiles
        else "dot"
        if row_major_needed(plan_distance, plan_tiles)
        else "panels"
    )
    log(f"the plan here: {variant_name(plan_rows, plan_distance, plan_kind)}")
    save_json(
        args.out,
        {
            "median_step_ms": summary,
            "steps_s": results,
            "plan_distance": plan_distance,
            "gemv_max_rows": plan_rows,
            "gemv_kind": plan_kind,
            "args": vars(args),
        },
    )


def variant_name(rows: int, distance: int, kind: str = "dot") -> str:
    if kind == "amx-tiles":
        return f"gemv<={rows} amx-tiles"
    if kind == "panels":
        return f"gemv<={rows} panels from 1 row"
    return f"gemv<={rows} prefetch {distance} B"


if __name__ == "__main__":
    main()
