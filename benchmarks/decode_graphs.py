"""Decode steps on a GPU: replayed CUDA graphs (the default) against eager (``--enforce-eager``).

Two engines on the same checkpoint in one process, measured in turns: for each batch size and
context length, the median step that decodes all ``batch`` fresh prompts of that length and
runs no prompt rows (a fixed 8,192-token budget puts the prompts in first), graphs
first in even rounds and eager first in odd ones. The first decode step of a run may capture
its bucket's graph (logged with its time by the engine); the median leaves it out.

    python -m benchmarks.decode_graphs [--model DIR] [--batches 1 4 16 64]
        [--contexts 64 1200] [--rounds 2]

Without CUDA it says so and saves a skipped record: the graphs are a GPU path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import bench_checkpoint, checkpoint_args, log, save_json, setup_env


def median_decode_step(engine, tag: str, batch: int, context: int, steps: int) -> float:
    """Median seconds of the decode-only steps of ``batch`` fresh ``context``-token prompts."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for b in range(batch):
        prompt = [100 + (b * 7 + i) % 900 for i in range(context)]  # distinct: no prefix hits
        engine.add_request(f"{tag}-{b}", {"prompt_token_ids": prompt}, params)
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t
        stats = engine.stats  # steps with prompt rows, or not all rows yet, are not timed
        if stats.last_step_prefill_tokens == 0 and stats.last_step_decode_tokens == batch:
            times.append(elapsed)
    return statistics.median(times[1:] or times)


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    checkpoint_args(ap, dtype="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 1200])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=8.0, help="per engine")
    ap.add_argument("--out", default="decode_graphs.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("no CUDA device: decode graphs are a GPU path")
        save_json(args.out, {"skipped": True, "args": vars(args)})
        return

    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine

    model = str(bench_checkpoint(args.family, args.model))
    # a fixed token budget: the prompts go in whole steps, and under the default time-sized
    # steps a graph engine's cheap decodes left prompt chunks in most of its steps for longer
    common = dict(
        model=model,
        dtype=args.dtype,
        device="cuda",
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=8192,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
    )
    engines = {
        "graphs": LLMEngine(EngineArgs(**common)),
        "eager": LLMEngine(EngineArgs(**common, enforce_eager=True)),
    }
    results: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    for r in range(args.rounds):
        for context in args.contexts:
            for batch in args.batches:
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                for name in order:
                    s = median_decode_step(
                        engines[name], f"{name}-{r}-{context}-{batch}", batch, context, args.steps
                    )
                    results[name].setdefault(f"{context}x{batch}", []).append(s)
                    log(f"round {r} {name:6} context {context:5} batch {batch:3}: {1e3 * s:.2f} ms")
    print(f"\n{'context':>8}{'batch':>6}{'graphs ms':>11}{'eager ms':>10}{'speed-up':>10}")
    table = []
    for key in results["graphs"]:
        context, batch = (int(x) for x in key.split("x"))
        g = statistics.median(results["graphs"][key])
        e = statistics.median(results["eager"][key])
        table.append({"context": context, "batch": batch, "graphs_s": g, "eager_s": e})
        print(f"{context:8}{batch:6}{1e3 * g:11.2f}{1e3 * e:10.2f}{e / g:9.2f}x")
    graphs = engines["graphs"].runner.decode_graphs
    print(f"graphs captured: {len(graphs.captured)}")
    save_json(
        args.out,
        {
            "device": torch.cuda.get_device_name(),
            "checkpoint": model,
            "table": table,
            "runs": results,
            "graphs_captured": len(graphs.captured),
            "args": vars(args),
        },
    )


if __name__ == "__main__":
    main()
