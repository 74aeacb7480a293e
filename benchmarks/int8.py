"""Weight-only int8 against the unquantized weights: decode step time at batch 1 and 8, weight
bytes per step and the bandwidth that implies, and greedy agreement / logit error over a fixed
prompt set.

    python -m benchmarks.int8                       # bench checkpoint; baseline = --dtype auto
    python -m benchmarks.int8 --dtype bfloat16      # int8 against bf16
    python -m benchmarks.int8 --dtype float32       # int8 against fp32 (eager, fp32 activations)
    python -m benchmarks.int8 --model DIR --steps 4 --prompts 2   # smoke

Both sides keep the baseline's activation dtype: with bf16 (``--dtype auto`` where the native
kernels build) the int8 side runs the fused decode step with int8 weights, and the agreement
and logit error printed are int8's against bf16's.

Writes results/int8.json. Baseline and int8 are loaded side by side into the same process and
timed in turns (``--rounds``, order reversed every round): the machines here move 20-40 %
between minutes, more than the effect measured. The step times are medians over the rounds'
medians.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from benchmarks.common import (
    bench_checkpoint,
    camera_frame,
    checkpoint_args,
    log,
    save_json,
    setup_env,
)
from benchmarks.machine import memory_bandwidth
from engine import LLM, SamplingParams
from engine.device import resolve_device, resolve_dtype

PROMPTS = [
    "Describe the people at the entrance and what they carry.",
    "Is anyone near the parked car? Answer in one sentence.",
    "Count the persons in the corridor and say where they walk.",
    "What is happening at the loading dock right now?",
    "Summarise the scene for a security guard.",
    "Which door did the person in the red jacket use?",
    "Describe the weather and the lighting.",
    "List the objects on the table.",
]


def weight_bytes(llm: LLM) -> int:
    """Bytes of decoder weights one decode step reads (linears, as stored; norms ignored)."""
    from engine.layers.quantized import Int8Linear

    total = 0
    for name, module in llm.engine.model.named_modules():
        if name.startswith("visual"):
            continue
        if isinstance(module, Int8Linear):
            total += module.qweight.numel() + module.scales.numel() * 4
        elif hasattr(module, "in_features") and hasattr(module, "out_features"):
            elem = torch.finfo(llm.engine.dtype).bits // 8
            total += module.in_features * module.out_features * elem
    return total


def decode_step_ms(llm, rows: int, steps: int) -> float:
    """Median wall time of a decode-only step with ``rows`` running sequences, of an ``LLM``
    or an ``LLMEngine``."""
    eng = getattr(llm, "engine", llm)
    # room for the steps whatever order the prompts finish in; the rest is aborted
    params = SamplingParams(temperature=0, max_tokens=steps + 512, ignore_eos=True)
    ids = [f"decode-{rows}-{i}" for i in range(rows)]
    # batch priority: with time limits asked for (a served engine), interactive prompts that
    # arrive beside a decoding one are prefilled a few tokens a step
    for i, request_id in enumerate(ids):
        eng.add_request(request_id, PROMPTS[i % len(PROMPTS)], params, priority="batch")
    # until every sequence has its first token: the steps after are decode-only
    while any(r.is_prefill for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    decoding = sum(1 for r in eng.scheduler.running if not r.is_prefill)
    for request_id in ids:
        eng.abort(request_id)
    if decoding != rows:
        raise RuntimeError(f"{decoding} of {rows} rows decoding after the timed steps")
    return statistics.median(times) * 1e3


def greedy_runs(llm: LLM, max_tokens: int, prompts: list, image) -> list[dict]:
    """Per prompt: greedy tokens and each step's logits (the sampler's input)."""
    runner = llm.engine.runner
    sample = runner._sample
    out = []
    for text in prompts:
        logs: list[torch.Tensor] = []

        def keep(logits, chunks, logs=logs):
            logs.append(logits.float()[0].clone())
            return sample(logits, chunks)

        runner._sample = keep
        try:
            conv = [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": image}, {"type": "text", "text": text}],
                }
            ]
            res = llm.chat(
                conv, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            )
        finally:
            runner._sample = sample
        out.append({"tokens": res[0].outputs[0].token_ids, "logits": logs})
    return out


def agreement(base: list[dict], quant: list[dict]) -> dict:
    """Token agreement (position by position, and whole sequences) and the relative logit
    error at steps where both saw the same tokens."""
    same = total = exact = 0
    errors = []
    for b, q in zip(base, quant, strict=True):
        exact += b["tokens"] == q["tokens"]
        for step, (x, y) in enumerate(zip(b["tokens"], q["tokens"], strict=True)):
            total += 1
            same += x == y
            if b["tokens"][:step] == q["tokens"][:step]:
                r, g = b["logits"][step], q["logits"][step]
                errors.append(((g - r).norm() / r.norm()).item())
    return {
        "token_agreement": same / total,
        "sequences_identical": exact,
        "sequences": len(base),
        "logit_rel_error_mean": statistics.mean(errors),
        "logit_rel_error_max": max(errors),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    checkpoint_args(ap, dtype="auto")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, the two sides in turns")
    args = ap.parse_args()
    setup_env()
    model = bench_checkpoint(args.family, args.model)
    dtype = resolve_dtype(args.dtype, resolve_device("auto"))
    bandwidth = memory_bandwidth()
    log(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s")
    image = camera_frame(448, 336)
    prompts = PROMPTS[: args.prompts]
    result: dict = {"model": str(model), "dtype": str(dtype), "bandwidth_gbs": bandwidth / 1e9}
    llms = {
        name: LLM(
            str(model),
            dtype=str(dtype).removeprefix("torch."),
            quantization=quant,
            cpu_kernels=args.cpu_kernels,
        )
        for name, quant in (("baseline", None), ("int8", "int8"))
    }
    timed: dict[str, dict[int, list[float]]] = {n: {b: [] for b in args.batches} for n in llms}
    for r in range(args.rounds):
        names = list(llms) if r % 2 == 0 else list(llms)[::-1]
        for b in args.batches:
            for name in names:
                timed[name][b].append(decode_step_ms(llms[name], b, args.steps))
    runs = {}
    for name, llm in llms.items():
        nbytes = weight_bytes(llm)
        steps = {b: statistics.median(v) for b, v in timed[name].items()}
        runs[name] = greedy_runs(llm, args.max_tokens, prompts, image)
        result[name] = {
            "weight_mb_per_step": nbytes / 1e6,
            "decode_step_ms": steps,
            "decode_step_ms_rounds": timed[name],
            "bandwidth_utilisation_batch1": (nbytes / (steps[args.batches[0]] / 1e3)) / bandwidth,
        }
        log(f"{name}: {nbytes / 1e6:.0f} MB/step, decode step ms {steps}")
    del llms
    gc.collect()
    result["speedup"] = {
        b: result["baseline"]["decode_step_ms"][b] / result["int8"]["decode_step_ms"][b]
        for b in args.batches
    }
    result["agreement"] = agreement(runs["baseline"], runs["int8"])
    log(f"speedup {result['speedup']}; agreement {result['agreement']}")
    save_json("int8.json", result)


if __name__ == "__main__":
    main()
