"""What chunked prefill costs: one prompt prefilled in fixed-size chunks vs in one step.

Sarathi-Serve's overhead figure: total prefill time of a long prompt split into chunks of
``--chunk`` tokens (each chunk re-reads the KV of all earlier chunks and runs the weights once
more) divided by the time of one pass over the whole prompt. Measured on

* a text prompt of ``--prompt-tokens`` random token ids (the pure language-model cost), and
* a camera frame prompt (``--image-size``), where the chunked run also splits the vision
  encoder into work items (the serving default) and the one-shot run encodes it whole.

The two engines take turns on the same prompts (fresh token ids / a fresh frame each time,
prefix caching off), and the overhead is the median of the per-pair ratios: on a shared
machine two runs of the same prefill differ by up to 10%, more than the effect measured.

    python -m benchmarks.chunking_overhead [--prompt-tokens 4096] [--chunk 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.common import (
    bench_checkpoint,
    camera_frame,
    checkpoint_args,
    log,
    save_json,
    setup_env,
)


def prefill_seconds(llm, prompt, steps: list[int] | None = None) -> float:
    """Engine-step time from admission to the prefill's last step (max_tokens=1: the request
    finishes in the step that completes its prefill)."""
    from engine import SamplingParams

    eng = llm.engine
    eng.add_request(f"overhead-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1))
    total, n = 0.0, 0
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        total += time.perf_counter() - t0
        n += 1
    if steps is not None:
        steps.append(n)
    return total


def summarise(times: list[float], steps: int) -> dict:
    return {
        "best_s": min(times),
        "median_s": statistics.median(times),
        "all_s": times,
        "steps": steps,
    }


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(description=__doc__)
    checkpoint_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--image-size", default="640x480")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="chunking_overhead.json")
    args = ap.parse_args()

    from engine import LLM

    model_dir = bench_checkpoint(args.family, args.model)
    w, h = (int(x) for x in args.image_size.split("x"))
    common = {"dtype": args.dtype, "enable_prefix_caching": False}
    budget = max(args.prompt_tokens, 8192)
    engines = {
        "chunked": LLM(str(model_dir), max_num_batched_tokens=args.chunk, **common),
        "one-shot": LLM(
            str(model_dir),
            max_num_batched_tokens=budget,
            enable_chunked_prefill=False,
            enable_chunked_encoder=False,
            **common,
        ),
    }
    vocab = engines["chunked"].engine.hf_config.text_config.vocab_size
    rng = np.random.default_rng(0)

    def text_prompts() -> list[dict]:
        # ids below the special tokens: plain text, never an image placeholder
        return [
            {"prompt_token_ids": rng.integers(0, vocab - 64, args.prompt_tokens).tolist()}
            for _ in range(args.repeats)
        ]

    def frame_prompts(seed: int) -> list[dict]:
        return [
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": camera_frame(w, h, seed=seed + i)},
                            {"type": "text", "text": "Describe the people in this frame."},
                        ],
                    }
                ]
            }
            for i in range(args.repeats)
        ]

    for llm in engines.values():  # warm-up: first calls pay allocator and kernel selection
        prefill_seconds(llm, {"prompt_token_ids": list(range(1, 64))})
        prefill_seconds(llm, text_prompts()[0])  # full-size activations allocated once
        prefill_seconds(llm, frame_prompts(1000)[0])
    # runs alternate between the two engines on the same prompt, in ABBA order, so slow drift
    # of a shared machine and whatever the previous run left in caches and the allocator hit
    # both sides alike; the ratio is taken per pair, then its median
    prompts = {"text": text_prompts(), "frame": frame_prompts(100)}
    times = {name: {kind: [] for kind in prompts} for name in engines}
    steps = {name: {} for name in engines}
    pair_ratios = {kind: [] for kind in prompts}
    for kind, batch in prompts.items():
        for i, prompt in enumerate(batch):
            order = list(engines.items())
            for name, llm in order if i % 2 == 0 else order[::-1]:  # ABBA: no order bias
                n: list[int] = []
                # the same frame twice would hit the encoder cache: each engine has its own
                times[name][kind].append(prefill_seconds(llm, prompt, n))
                steps[name][kind] = n[0]
            pair_ratios[kind].append(times["chunked"][kind][-1] / times["one-shot"][kind][-1])
            log(f"{kind}: chunked / one-shot = {pair_ratios[kind][-1]:.3f}")
    results = {
        name: {kind: summarise(times[name][kind], steps[name][kind]) for kind in prompts}
        for name in engines
    }
    frame_tokens = len(engines["chunked"].engine.process_inputs(frame_prompts(0)[0]).token_ids)
    ratios = {kind: statistics.median(r) for kind, r in pair_ratios.items()}
    print(f"\nchunking overhead, chunks of {args.chunk} tokens ({args.dtype})")
    print(
        "| prompt | chunked s (median) | one-shot s (median) | chunked / one-shot "
        "(median of pairs) |\n| --- | --- | --- | --- |"
    )
    for kind, label in (
        ("text", f"text, {args.prompt_tokens} tokens"),
        ("frame", f"frame {args.image_size}, {frame_tokens} tokens"),
    ):
        c, o = results["chunked"][kind], results["one-shot"][kind]
        print(
            f"| {label} | {c['median_s']:.3f} ({c['steps']} steps) | {o['median_s']:.3f} "
            f"| {ratios[kind]:.3f} |"
        )
    save_json(
        args.out,
        {
            "args": vars(args),
            "frame_tokens": frame_tokens,
            "results": results,
            "pair_ratios": pair_ratios,
            "ratios": ratios,
        },
    )


if __name__ == "__main__":
    main()
