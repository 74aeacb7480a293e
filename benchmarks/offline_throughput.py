"""Offline throughput: our engine vs ``transformers`` ``generate()`` on the same checkpoint.

Also measures, in the same run, the machine's bf16 matmul peak and memory bandwidth, and from
them single-stream decode bandwidth utilisation and frame-prompt prefill MFU, both ways.

    python -m benchmarks.offline_throughput                 # bench checkpoint, CPU defaults
    python -m benchmarks.offline_throughput --num-requests 4 --max-tokens 8 --model DIR  # smoke
    python -m benchmarks.offline_throughput --workload text --max-tokens 128  # decode-bound
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import (
    bench_checkpoint,
    camera_frame,
    checkpoint_args,
    log,
    save_json,
    setup_env,
)
from benchmarks.machine import matmul_peak_flops, memory_bandwidth, synchronize
from engine.device import cpu_has_fast_bf16, resolve_device, resolve_dtype


def conv(i: int, image) -> list[dict]:
    text = f"Camera {i}: describe the people in this frame and what they are doing."
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": text}],
        }
    ]


TOPICS = ["the city tram", "a weekend hike", "camera sensors", "the harbour at night"]


def text_conv(i: int) -> list[dict]:
    """A chat request without an image: the decode-heavy workload (``--workload text``)."""
    text = f"Request {i}: tell me, at length, about {TOPICS[i % len(TOPICS)]}."
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


def workload_conv(args, i: int, frames) -> list[dict]:
    return text_conv(i) if args.workload == "text" else conv(i, frames[i % len(frames)])


def text_params(model_dir, bytes_per_param: int) -> tuple[int, int]:
    """(decoder matmul parameters per token incl. lm_head, weight bytes read per decode step),
    counted from the checkpoint (the engine's packed layers hide their parameters)."""
    from safetensors import safe_open

    n, embed, head = 0, 0, 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                numel = f.get_slice(name).get_shape()
                count = 1
                for d in numel:
                    count *= d
                if "visual" in name:
                    continue
                if "embed_tokens" in name:
                    embed = count
                elif name.endswith("lm_head.weight"):
                    head = count
                else:
                    n += count
    n += head or embed  # a tied head reads the embedding matrix
    return n, n * bytes_per_param


def head_params(model_dir) -> int:
    """lm_head parameters (the embedding matrix when tied)."""
    from safetensors import safe_open

    embed = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = f.get_slice(name).get_shape()
                if name.endswith("lm_head.weight"):
                    return shape[0] * shape[1]
                if "embed_tokens" in name and "visual" not in name:
                    embed = shape[0] * shape[1]
    return embed


def prefill_flops(model_dir, cfg, tokens: int) -> float:
    """A prompt's decoder FLOPs: every token through the layers, one through the lm_head
    (only the last position's logits are computed), plus causal attention."""
    n_params, _ = text_params(model_dir, 2)
    head = head_params(model_dir)
    return 2 * (n_params - head) * tokens + 2 * head + attention_flops(cfg, tokens)


def attention_flops(cfg, tokens: int) -> float:
    """Causal attention QK^T and PV over a prompt: 2 matmuls x 2 FLOP x heads x d x T^2 / 2."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * tokens * tokens / 2


# ---- our engine ------------------------------------------------------------------------------
def ours(args, model_dir, frames):
    from engine import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.num_requests,
        cpu_kernels=args.cpu_kernels,
        device=args.device,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
    )
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = camera_frame(frames[0].width, frames[0].height, seed=999)  # not one of the frames
    llm.chat(conv(0, warm), SamplingParams(temperature=0, max_tokens=2))  # warm-up

    # throughput: all requests at once
    convs = [workload_conv(args, i, frames) for i in range(args.num_requests)]
    t0 = time.perf_counter()
    outs = llm.chat(convs, params)
    elapsed = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)

    # single-stream decode: per-step time once the prompt is in
    eng.add_request(
        "decode",
        [{"role": "user", "content": "Say something long."}],
        SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True),
    )
    eng.step()
    times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    decode_step = statistics.median(times)

    # frame prefill: one ~1,000-token image prompt, alone, timed step by step until its first
    # token (the encoder may take more than one step under the budget)
    fresh = camera_frame(frames[0].width, frames[0].height, seed=12345)  # not in any cache
    eng.add_request("prefill", conv(99, fresh), SamplingParams(temperature=0, max_tokens=1))
    prefill_total = encoder_s = 0.0
    prefill_tokens = 0
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        prefill_total += time.perf_counter() - t
        encoder_s += eng.stats.last_step_encoder_s
        prefill_tokens += eng.stats.last_step_prefill_tokens
    return {
        "elapsed_s": elapsed,
        "generated_tokens": gen,
        "prompt_tokens": prompt,
        "output_tok_s": gen / elapsed,
        "total_tok_s": (gen + prompt) / elapsed,
        "decode_step_s": decode_step,
        "prefill_tokens": prefill_tokens,
        "prefill_total_s": prefill_total,
        "prefill_encoder_s": encoder_s,
        "prefill_lm_s": prefill_total - encoder_s,
        "model": eng.model,
        "cfg": eng.hf_config.text_config,
    }


# ---- transformers baseline ---------------------------------------------------------------------
def hf(args, model_dir, frames, dtype, device):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    def encode(c):
        parts = c[0]["content"]
        if parts[0]["type"] == "text":  # --workload text
            text = processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            return processor(text=[text], return_tensors="pt").to(device)
        msgs = [{"role": "user", "content": [{"type": "image"}, parts[1]]}]
        text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        enc = processor(text=[text], images=[parts[0]["image"]], return_tensors="pt")
        return enc.to(device)

    def generate(enc, n):
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        synchronize(device)
        return out

    generate(encode(conv(0, frames[0])), 2)  # warm-up
    n_req = min(args.hf_requests, args.num_requests)
    t0 = time.perf_counter()
    gen = 0
    for i in range(n_req):
        enc = encode(workload_conv(args, i, frames))
        out = generate(enc, args.max_tokens)
        gen += out.shape[1] - enc["input_ids"].shape[1]
    elapsed = time.perf_counter() - t0

    text_msgs = [{"role": "user", "content": [{"type": "text", "text": "Say something long."}]}]
    text = processor.apply_chat_template(text_msgs, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], return_tensors="pt").to(device)
    t = time.perf_counter()
    generate(enc, 1)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    generate(enc, args.decode_tokens)
    tn = time.perf_counter() - t
    decode_step = (tn - t1) / (args.decode_tokens - 1)

    enc = encode(conv(99, frames[-1]))
    with torch.inference_mode():
        t = time.perf_counter()
        model.model.get_image_features(enc["pixel_values"], enc["image_grid_thw"])
        synchronize(device)
        vision_s = time.perf_counter() - t
    t = time.perf_counter()
    generate(enc, 1)
    prefill_total = time.perf_counter() - t
    return {
        "requests": n_req,
        "elapsed_s": elapsed,
        "output_tok_s": gen / elapsed,
        "decode_step_s": decode_step,
        "prefill_tokens": enc["input_ids"].shape[1],
        "prefill_total_s": prefill_total,
        "prefill_encoder_s": vision_s,
        "prefill_lm_s": prefill_total - vision_s,
    }


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    checkpoint_args(ap)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--hf-requests", type=int, default=3, help="requests run through transformers")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--image-size", default="640x480")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (both engines run there)")
    ap.add_argument(
        "--enforce-eager", action="store_true", help="GPU: decode steps eager, not CUDA graphs"
    )
    ap.add_argument(
        "--hf-dtype",
        default="best",
        help="transformers' dtype; 'best': ours where the hardware has bf16 arithmetic (GPU, "
        "AVX512-BF16, AMX), else float32 (bf16 emulated is transformers' slowest choice)",
    )
    ap.add_argument(
        "--workload",
        choices=["image", "text"],
        default="image",
        help="image: one camera frame per request (vision-tower-bound on a CPU); text: chat "
        "prompts alone (decode-bound)",
    )
    ap.add_argument(
        "--quantization",
        choices=["none", "int8"],
        default="none",
        help="our engine's weights (transformers keeps its dtype): int8 reads 1 byte a weight",
    )
    ap.add_argument("--out", default="offline_throughput.json")
    args = ap.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.hf_dtype == "best":
        native = device.type == "cuda" or cpu_has_fast_bf16()
        hf_dtype = dtype if native else torch.float32
    else:
        hf_dtype = resolve_dtype(args.hf_dtype, device, cpu_kernels=False)
    w, h = (int(x) for x in args.image_size.split("x"))
    model_dir = bench_checkpoint(args.family, args.model)
    # one distinct frame per request: repeated frames would hit the prefix cache and flatter us
    frames = [camera_frame(w, h, seed=s) for s in range(args.num_requests)]

    log("measuring machine limits")
    peak = matmul_peak_flops(dtype, device=device)
    bandwidth = memory_bandwidth(device=device)
    log(f"{args.dtype} matmul peak {peak / 1e9:.0f} GFLOP/s, bandwidth {bandwidth / 1e9:.1f} GB/s")

    log(f"our engine: {args.num_requests} {args.workload} requests x {args.max_tokens} tokens")
    o = ours(args, model_dir, frames)
    log(f"transformers generate(): {args.hf_requests} requests one at a time")
    b = hf(args, model_dir, frames, hf_dtype, device)

    o.pop("model")
    cfg = o.pop("cfg")
    weight_bytes = 1 if args.quantization == "int8" else dtype.itemsize
    n_params, bytes_per_token = text_params(model_dir, weight_bytes)
    bound_step = bytes_per_token / bandwidth

    def prefill_mfu(r):
        flops = prefill_flops(model_dir, cfg, r["prefill_tokens"])
        return flops / r["prefill_lm_s"] / peak

    summary = {
        "machine": {
            "peak_gflops": peak / 1e9,
            "bandwidth_gbs": bandwidth / 1e9,
            "threads": torch.get_num_threads(),
            "device": str(device),
        },
        "checkpoint": str(model_dir),
        "dtype": str(dtype),
        "hf_dtype": str(hf_dtype),
        "decoder_params_m": n_params / 1e6,
        "ours": o,
        "transformers": b,
        "throughput_ratio": o["output_tok_s"] / b["output_tok_s"],
        "decode_bw_util": {
            "ours": bound_step / o["decode_step_s"],
            # transformers streams its own dtype's bytes
            "transformers": bound_step * hf_dtype.itemsize / weight_bytes / b["decode_step_s"],
        },
        "prefill_mfu": {"ours": prefill_mfu(o), "transformers": prefill_mfu(b)},
        "args": vars(args),
    }
    print()
    rows = [
        ("output tok/s", o["output_tok_s"], b["output_tok_s"], ".1f"),
        ("decode step ms", o["decode_step_s"] * 1e3, b["decode_step_s"] * 1e3, ".1f"),
        ("decode bandwidth util", *summary["decode_bw_util"].values(), ".1%"),
        ("frame prefill tokens", o["prefill_tokens"], b["prefill_tokens"], "d"),
        ("  vision tower s", o["prefill_encoder_s"], b["prefill_encoder_s"], ".2f"),
        ("  language model s", o["prefill_lm_s"], b["prefill_lm_s"], ".2f"),
        ("  LM prefill MFU", *summary["prefill_mfu"].values(), ".1%"),
    ]
    print(f"{'':28}{'ours':>12}{'transformers':>14}")
    for name, ours_v, hf_v, fmt in rows:
        print(f"{name:28}{ours_v:12{fmt}}{hf_v:14{fmt}}")
    print(f"throughput ratio (ours / transformers): {summary['throughput_ratio']:.2f}x")
    save_json(args.out, summary)


if __name__ == "__main__":
    main()
