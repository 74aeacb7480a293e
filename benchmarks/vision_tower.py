"""Vision tower micro-benchmark: ms per 640x480 frame, our forward vs the ``transformers`` tower.

Both run the same weights of the bench checkpoint, fp32 and bf16. Ours is timed one-shot and
as a job cut into ``--max-rows`` row items (what the scheduler runs), whose slowest single
item bounds the stall a step that carries vision work can add.

    python -m benchmarks.vision_tower                       # bench qwen2_vl, fp32 and bf16
    python -m benchmarks.vision_tower --families qwen2_vl qwen2_5_vl --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import bench_checkpoint, camera_frame, log, save_json, setup_env

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def frame_inputs(model_dir, width: int, height: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values and grid_thw of one synthetic camera frame, via the checkpoint's processor."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model_dir)
    enc = processor(images=[camera_frame(width, height)], return_tensors="pt")
    return enc["pixel_values"], enc["image_grid_thw"]


def interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Wall times of each ``fn``, taken in turn every repeat after one warm-up round.

    Interleaving puts the contenders under the same background load: the machine is shared.
    """
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def summary(times: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(times), "best_ms": min(times)}


def run_split_job(split, pixels, grid, slowest: list[float]) -> None:
    """One job run item by item, appending its slowest item's ms (the stall it can add)."""
    job = split.job(pixels, grid)
    worst = 0.0
    while not job.done():
        t = time.perf_counter()
        # exactly one whole item per call (a smaller allowance would cut it into pieces)
        job.advance(job.next_cost())
        worst = max(worst, (time.perf_counter() - t) * 1e3)
    slowest.append(worst)


def bench_dtype(model_dir, dtype: torch.dtype, pixels, grid, args) -> dict:
    from engine.kernels import load_cpu_decode
    from engine.models import load_model
    from engine.models.vision_encoder import VisionTower

    # bf16: as the engine runs it, with engine/kernels' flash attention and packed linears
    native = dtype == torch.bfloat16 and load_cpu_decode() is not None
    model, hf_config, arch = load_model(model_dir, dtype, torch.device("cpu"), cpu_kernels=native)
    kernels = model.cpu_kernels
    # transformers' own tower on its own copy, plain linears in the dtype asked for: ours packs
    # the linears of the shared module, and runs a bf16 model's tower in fp32 where the CPU has
    # no bf16 arithmetic (engine.models.vision_compute_dtype)
    plain = load_model(
        model_dir, dtype, torch.device("cpu"), pack_cpu_weights=False, cpu_kernels=False
    )[0]
    for param in plain.visual.parameters():
        param.data = param.data.to(dtype)
    tower = VisionTower(model.visual, hf_config.vision_config, arch, kernels=kernels)
    split = VisionTower(model.visual, hf_config.vision_config, arch, args.max_rows, kernels=kernels)
    pixels = pixels.to(dtype)

    def hf() -> torch.Tensor:
        with torch.inference_mode():
            return plain.visual(pixels, grid_thw=grid).pooler_output

    def ours() -> list[torch.Tensor]:
        return tower.encode(pixels, grid)

    slowest: list[float] = []
    diff = (torch.cat(ours()).float() - hf().float()).abs().max().item()
    times = interleaved_ms(
        {
            "transformers": hf,
            "ours": ours,
            "ours_split": lambda: run_split_job(split, pixels, grid, slowest),
        },
        args.repeats,
    )
    out = {name: summary(t) for name, t in times.items()}
    job = split.job(pixels, grid)
    out["ours_split"].update(
        items=len(job.items), total_cost=job.total_cost, max_item_ms=statistics.median(slowest)
    )
    out["max_abs_diff_vs_transformers"] = diff
    out["speedup_median"] = out["transformers"]["median_ms"] / out["ours"]["median_ms"]
    return out


def bench_family(family: str, args) -> dict:
    model_dir = bench_checkpoint(family, args.model)
    pixels, grid = frame_inputs(model_dir, args.width, args.height)
    out: dict = {"patches": int(grid.prod(-1).sum())}
    for name in args.dtypes:
        log(f"benchmarking {family} {name} ({out['patches']} patches per frame)")
        out[name] = r = bench_dtype(model_dir, DTYPES[name], pixels, grid, args)
        split = r["ours_split"]
        print(
            f"{family} {name}: transformers {r['transformers']['median_ms']:.1f} ms/frame, "
            f"ours {r['ours']['median_ms']:.1f} ms/frame (x{r['speedup_median']:.2f}), "
            f"split@{args.max_rows} rows {split['median_ms']:.1f} ms in {split['items']} items "
            f"(slowest {split['max_item_ms']:.1f} ms), "
            f"max |diff| {r['max_abs_diff_vs_transformers']:.2e}",
            flush=True,
        )
    return out


def main() -> None:
    setup_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families", nargs="+", default=["qwen2_vl"], choices=("qwen2_vl", "qwen2_5_vl")
    )
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-rows", type=int, default=512, help="rows per item, split job")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--model", help="checkpoint dir (default: the family's bench preset)")
    parser.add_argument("--out", default="vision_tower.json")
    args = parser.parse_args()

    result = {
        "frame": f"{args.width}x{args.height}",
        "threads": torch.get_num_threads(),
        "max_rows_per_item": args.max_rows,
        "repeats": args.repeats,
    }
    for family in args.families:
        result[family] = bench_family(family, args)
    save_json(args.out, result)


if __name__ == "__main__":
    main()
