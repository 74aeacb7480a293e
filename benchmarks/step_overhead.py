"""Where a decode step's time goes: the fused kernel's forward against everything around it.

On a CPU the kernel streams the weights; the rest (scheduling, the step's input tensors,
sampling, detokenising, the cost model) is single-threaded Python while the other cores wait.
For B = each ``--batches`` value, B chat requests decode together in an engine built as the
server builds it (steps sized by time); per step: the median wall time, and the mean time in
the kernel's forward, in the runner's input preparation around it, in sampling and in the
scheduler. ``overhead`` is the step minus the kernel.

    python -m benchmarks.step_overhead [--batches 1 4 16] [--tokens 96]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

from benchmarks.common import bench_checkpoint, checkpoint_args, log, save_json, setup_env

PROMPTS = [
    "Tell me about the history of the city tram.",
    "What should I pack for a weekend hike?",
    "Explain how a camera sensor works.",
    "Write a short poem about the harbour at night.",
]


class _Timed:
    """Adds the wall time of each call of ``fn`` to ``totals[key]``."""

    def __init__(self, fn: Callable, totals: dict[str, float], key: str) -> None:
        self.fn, self.totals, self.key = fn, totals, key

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.totals[self.key] += time.perf_counter() - t


class _TimedDecoder:
    """The fused decoder with its forward timed."""

    def __init__(self, decoder, totals: dict[str, float]) -> None:
        self._decoder = decoder
        self.forward = _Timed(decoder.forward, totals, "kernel")

    def __getattr__(self, name: str):
        return getattr(self._decoder, name)


def measure(engine, batch: int, tokens: int, totals: dict[str, float]) -> dict[str, float]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", PROMPTS[i % 4], params)
    while any(r.is_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    totals.clear()
    steps: list[float] = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    n = len(steps)
    row = {"steps": n, "step_ms_median": 1e3 * statistics.median(steps)}
    row["step_ms_mean"] = 1e3 * sum(steps) / n
    for key in ("kernel", "inputs", "sample", "schedule"):
        row[f"{key}_ms"] = 1e3 * totals[key] / n
    row["inputs_ms"] -= row["kernel_ms"]  # the preparation around the kernel call
    row["overhead_ms"] = row["step_ms_mean"] - row["kernel_ms"]
    return row


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(description=__doc__)
    checkpoint_args(ap, dtype="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=96, help="decode steps per batch")
    ap.add_argument("--out", default="step_overhead.json")
    args = ap.parse_args()

    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine

    model = bench_checkpoint(args.family, args.model)
    engine = LLMEngine(EngineArgs(model=str(model), dtype=args.dtype, cpu_kernels=args.cpu_kernels))
    runner = engine.runner
    if runner.fused_decoder is None:
        raise SystemExit("no fused decode kernel here: nothing to split the step against")
    totals: dict[str, float] = defaultdict(float)
    runner.fused_decoder = _TimedDecoder(runner.fused_decoder, totals)
    runner._fused_decode_logits = _Timed(runner._fused_decode_logits, totals, "inputs")
    runner._sample = _Timed(runner._sample, totals, "sample")
    engine.scheduler.schedule = _Timed(engine.scheduler.schedule, totals, "schedule")
    measure(engine, 1, 8, totals)  # warm-up
    rows = {}
    for batch in args.batches:
        row = measure(engine, batch, args.tokens, totals)
        rows[str(batch)] = row
        log(
            f"batch {batch:2d}: step {row['step_ms_median']:6.2f} ms (median) | kernel "
            f"{row['kernel_ms']:6.2f}, overhead {row['overhead_ms']:5.2f} = inputs "
            f"{row['inputs_ms']:.2f} + sampling {row['sample_ms']:.2f} + scheduling "
            f"{row['schedule_ms']:.2f} + the rest"
        )
    save_json(args.out, {"batches": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
