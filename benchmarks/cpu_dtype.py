"""Which dtype ``--dtype auto`` should pick on this CPU: fp32 (eager PyTorch) against bf16 (the
native kernels where they build), and optionally weight-only int8, on the same checkpoint.

    python -m benchmarks.cpu_dtype                         # bench checkpoint, b1 and b8
    python -m benchmarks.cpu_dtype --int8 --steps 30       # int8 too (bf16 and fp32 activations)
    python -m benchmarks.cpu_dtype --configs bf16 int8     # only these, e.g. the int8 ratio
    python -m benchmarks.cpu_dtype --model DIR --steps 4   # smoke

Configurations: ``fp32``, ``bf16``, ``int8`` (int8 weights, bf16 activations: the fused decode
step where the kernels build) and ``int8-fp32`` (int8 weights, fp32 activations: eager with
the int8 GEMV). With ``bf16`` and ``int8`` both measured, the int8 speedup per batch size
(bf16 step / int8 step, of the medians) is printed and saved.

Per configuration: the median decode step at each batch size (``benchmarks.int8``'s
``decode_step_ms``) and text prefill tokens/s (a ``--prefill-tokens`` prompt, one output
token). All configurations are loaded into one process and measured in turns, ``--rounds``
times: on a machine shared with other work, load then falls on each alike; the figures are
the medians over rounds, with the load average seen. Writes results/cpu_dtype.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.common import bench_checkpoint, checkpoint_args, log, save_json, setup_env
from benchmarks.int8 import decode_step_ms
from engine import LLM, SamplingParams

# name -> (dtype, quantization)
CONFIGS = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("bfloat16", "int8"),
    "int8-fp32": ("float32", "int8"),
}


def prefill_tokens_per_s(llm: LLM, tokens: int, tag: str) -> float:
    """Prompt tokens per second of a text-only prefill of about ``tokens`` tokens."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    # a new first word each call: the prefix cache must not serve the prompt
    words = " ".join(f"w{tag}x{j % 97}" for j in range(tokens // 5))  # ~5 tokens a word
    eng.add_request(f"prefill-{tag}", words, params)
    n = eng.scheduler.waiting[-1].num_prompt_tokens
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    checkpoint_args(ap, dtype="auto")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prefill-tokens", type=int, default=512, help="0: decode steps only")
    ap.add_argument(
        "--int8", action="store_true", help="also int8 weights (with bf16 and fp32 activations)"
    )
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="these configurations only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch threads (default: PyTorch's choice)")
    args = ap.parse_args()
    setup_env()
    if args.threads:  # one thread: no barrier waits on a core another process holds
        torch.set_num_threads(args.threads)
    model = bench_checkpoint(args.family, args.model)
    names = args.configs or ["fp32", "bf16", *(["int8", "int8-fp32"] if args.int8 else [])]
    llms = {
        name: LLM(
            str(model),
            dtype=CONFIGS[name][0],
            quantization=CONFIGS[name][1],
            cpu_kernels=args.cpu_kernels,
        )
        for name in names
    }
    for name, llm in llms.items():  # warm-up: first-call allocations, kernel caches
        decode_step_ms(llm, 1, 2)
        if args.prefill_tokens:
            prefill_tokens_per_s(llm, args.prefill_tokens, f"warm{name}")
    runs: dict = {name: {"decode": {b: [] for b in args.batches}, "prefill": []} for name in llms}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name, llm in llms.items():
            for b in args.batches:
                runs[name]["decode"][b].append(decode_step_ms(llm, b, args.steps))
            if args.prefill_tokens:
                runs[name]["prefill"].append(prefill_tokens_per_s(llm, args.prefill_tokens, f"{r}"))
            shown = ", ".join(f"b{b} {v[-1]:.1f} ms" for b, v in runs[name]["decode"].items())
            log(f"  {name}: {shown}; prefill {runs[name]['prefill'][-1:]} tok/s")
        log(f"round {r + 1}/{args.rounds} done (load average {loads[-1]:.2f})")
    result: dict = {
        "model": str(model),
        "threads": torch.get_num_threads(),
        "load_average_1min": loads,
    }
    for name, llm in llms.items():
        steps = {b: statistics.median(v) for b, v in runs[name]["decode"].items()}
        prefill = statistics.median(runs[name]["prefill"] or [0.0])
        fused = llm.engine.runner.fused_decoder is not None
        result[name] = {"fused_decode": fused, "decode_step_ms": steps, "prefill_tok_s": prefill}
        shown = ", ".join(f"b{b} {ms:.1f} ms" for b, ms in steps.items())
        log(
            f"{name:5} (fused decode {fused!s:5}): decode step {shown}; prefill {prefill:.0f} tok/s"
        )
    if "bf16" in result and "int8" in result:
        # per round (same load), then the median: the ratio of medians hides which round won
        ratio = {
            b: statistics.median(
                x / y
                for x, y in zip(runs["bf16"]["decode"][b], runs["int8"]["decode"][b], strict=True)
            )
            for b in args.batches
        }
        result["int8_speedup_over_bf16"] = ratio
        log(
            "int8 decode step speedup over bf16: "
            + ", ".join(f"b{b} {r:.2f}x" for b, r in ratio.items())
        )
    save_json("cpu_dtype.json", result)


if __name__ == "__main__":
    main()
