"""How close to the machine the engine runs: prefill MFU and decode bandwidth utilisation.

Measures, in one run: the machine's matmul peak (fp32, bf16) and read bandwidth; the engine's
prefill FLOP/s on a ~1,000-token prompt (2 x decoder params x tokens + causal attention) and
its decode bytes/s at batch 1, 8 and 16 (weights + KV read per step; up to 8 rows run the fused
kernel, see engine/kernels). Prints the ratios.

    python -m benchmarks.roofline [--model DIR] [--prompt-tokens 1000] [--no-cpu-kernels]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import bench_checkpoint, checkpoint_args, log, save_json, setup_env
from benchmarks.machine import matmul_peak_flops, memory_bandwidth
from benchmarks.offline_throughput import prefill_flops, text_params
from engine.device import resolve_dtype


def decode_bytes_per_step(n_params: int, elem: int, cfg, contexts: list[int]) -> int:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem
    return n_params * elem + sum(contexts) * kv


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(description=__doc__)
    checkpoint_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--decode-steps", type=int, default=48)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--out", default="roofline.json")
    args = ap.parse_args()

    from engine import LLM, SamplingParams

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    elem = torch.tensor([], dtype=dtype).element_size()
    model_dir = bench_checkpoint(args.family, args.model)
    log("measuring machine limits")
    machine = {
        "fp32_peak_gflops": matmul_peak_flops(torch.float32) / 1e9,
        "bf16_peak_gflops": matmul_peak_flops(torch.bfloat16) / 1e9,
        "bandwidth_gbs": memory_bandwidth() / 1e9,
    }
    peak = machine["bf16_peak_gflops" if dtype == torch.bfloat16 else "fp32_peak_gflops"] * 1e9
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_num_batched_tokens=8192,
        cpu_kernels=args.cpu_kernels,
    )
    eng = llm.engine
    cfg = eng.hf_config.text_config
    n_params, _ = text_params(model_dir, elem)

    # prefill: a token-id prompt of exactly N tokens, one step
    text = "people walk past the camera at the station entrance " * args.prompt_tokens
    ids = eng.tokenizer(text)["input_ids"][: args.prompt_tokens]  # real text, no special ids
    eng.add_request("warm", {"prompt_token_ids": ids[:64]}, SamplingParams(max_tokens=1))
    while eng.has_unfinished():
        eng.step()
    times = []
    for r in range(3):
        eng.add_request(f"p{r}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
        while eng.has_unfinished():
            eng.step()
    prefill_s = min(times)
    flops = prefill_flops(model_dir, cfg, args.prompt_tokens)
    result = {
        "machine": machine,
        "prefill_s": prefill_s,
        "prefill_gflops": flops / prefill_s / 1e9,
        "prefill_mfu": flops / prefill_s / peak,
        "decode": {},
    }
    mfu = result["prefill_mfu"]
    log(f"prefill {args.prompt_tokens} tokens: {prefill_s * 1e3:.0f} ms, MFU {mfu:.1%}")

    bandwidth = machine["bandwidth_gbs"] * 1e9
    for batch in (int(b) for b in args.batches.split(",")):
        for i in range(batch):
            eng.add_request(
                f"d{batch}-{i}",
                {"prompt_token_ids": ids[:128]},
                SamplingParams(max_tokens=args.decode_steps, ignore_eos=True),
            )
        eng.step()  # prefills
        step_times, bytes_read = [], []
        while eng.has_unfinished():
            contexts = [r.num_computed_tokens + 1 for r in eng.scheduler.running]
            t = time.perf_counter()
            eng.step()
            step_times.append(time.perf_counter() - t)
            bytes_read.append(decode_bytes_per_step(n_params, elem, cfg, contexts))
        step = statistics.median(step_times)
        achieved = statistics.median(bytes_read) / step
        result["decode"][batch] = {
            "step_ms": step * 1e3,
            "gbs": achieved / 1e9,
            "bandwidth_util": achieved / bandwidth,
            "tok_s": batch / step,
        }
        log(
            f"decode batch {batch}: {step * 1e3:.1f} ms/step, {achieved / 1e9:.1f} GB/s "
            f"= {achieved / bandwidth:.1%} of {machine['bandwidth_gbs']:.1f} GB/s"
        )
    print(
        f"\nmachine: bf16 {machine['bf16_peak_gflops']:.0f} GFLOP/s, fp32 "
        f"{machine['fp32_peak_gflops']:.0f} GFLOP/s, read {machine['bandwidth_gbs']:.1f} GB/s"
    )
    print(f"prefill MFU: {result['prefill_mfu']:.1%} ({result['prefill_gflops']:.0f} GFLOP/s)")
    for batch, d in result["decode"].items():
        print(
            f"decode batch {batch}: bandwidth utilisation {d['bandwidth_util']:.1%}, "
            f"{d['tok_s']:.0f} tok/s"
        )
    save_json(args.out, result)


if __name__ == "__main__":
    main()
