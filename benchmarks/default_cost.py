"""What the default (steps sized by time) costs when only one kind of work runs.

Issue 14's last target: time-sized steps exist for mixed load (chat beside camera frames); when
only camera frames run, or only chat streams, they must not cost more than 5 % of the
throughput of a fixed large token budget (``--max-num-batched-tokens 2048``, the "offline"
setting). Two engines are built from the same checkpoint, one with the default flags and one
with the fixed budget, and take turns (ABBA) on the same workloads:

* **camera only**: ``--frames`` fresh camera frames (``priority: batch``, ``--camera-tokens``
  output tokens each) submitted at once: frames per minute;
* **chat only**: ``--num-chat`` chat requests (``--prompt-tokens`` random prompt tokens,
  ``--chat-tokens`` output tokens, ``priority: interactive``) submitted at once: generated
  tokens per second.

The cost is ``1 - default / fixed`` from the median of the per-pair ratios (a shared machine
moves the same run by 10 % between minutes; pairs taken back to back see the same minute).

    python -m benchmarks.default_cost [--repeats 3] [--frames 4] [--num-chat 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import bench_checkpoint, checkpoint_args, log, save_json, setup_env
from benchmarks.encoder_beside_chat import frame_request

FIXED_BUDGET = 2048


def run_to_completion(engine, requests: list[tuple[str, dict, object, str]]) -> float:
    """Seconds from submitting ``requests`` to the last one finishing (preprocessing included:
    a server pays it too)."""
    t = time.perf_counter()
    for request_id, inputs, params, priority in requests:
        engine.add_request(request_id, inputs, params, priority=priority)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t


def camera_requests(args, run: int) -> list[tuple[str, dict, object, str]]:
    from engine.sampling_params import SamplingParams

    width, height = (int(v) for v in args.image_size.split("x"))
    params = SamplingParams(temperature=0, max_tokens=args.camera_tokens, ignore_eos=True)
    return [
        # a fresh frame each time: no encoder or prefix cache hit across runs
        (f"frame-{run}-{k}", frame_request(width, height, seed=1000 * run + k), params, "batch")
        for k in range(args.frames)
    ]


def chat_requests(args, run: int, vocab: int) -> list[tuple[str, dict, object, str]]:
    import random

    from engine.sampling_params import SamplingParams

    rng = random.Random(run)
    params = SamplingParams(temperature=0, max_tokens=args.chat_tokens, ignore_eos=True)
    return [
        (
            f"chat-{run}-{i}",
            {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]},
            params,
            "interactive",
        )
        for i in range(args.num_chat)
    ]


def paired_cost(pairs: list[tuple[float, float]]) -> float:
    """1 - default throughput / fixed throughput, from the median per-pair time ratio."""
    return 1.0 - statistics.median(fixed / default for default, fixed in pairs)


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(description=__doc__)
    checkpoint_args(ap, dtype="auto")
    ap.add_argument("--repeats", type=int, default=3, help="ABBA pairs per workload")
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--image-size", default="640x480")
    ap.add_argument("--camera-tokens", type=int, default=16)
    ap.add_argument("--num-chat", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--chat-tokens", type=int, default=96)
    ap.add_argument(
        "--workloads", nargs="+", default=["camera", "chat"], choices=["camera", "chat"]
    )
    ap.add_argument("--out", default="default_cost.json")
    args = ap.parse_args()

    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine

    model = str(bench_checkpoint(args.family, args.model))
    common = {"model": model, "dtype": args.dtype, "cpu_kernels": args.cpu_kernels}
    engines = {
        "default": LLMEngine(EngineArgs(**common)),
        "fixed": LLMEngine(EngineArgs(**common, max_num_batched_tokens=FIXED_BUDGET)),
    }
    vocab = min(engines["default"].tokenizer.vocab_size, 30_000)
    builders = {
        "camera": lambda run: camera_requests(args, run),
        "chat": lambda run: chat_requests(args, run, vocab),
    }
    workloads = {name: builders[name] for name in args.workloads}
    for name, engine in engines.items():  # warm: first-call costs belong to neither side
        run_to_completion(engine, [r for w in workloads.values() for r in w(10_000)[:1]])
        log(f"{name}: warm")
    results: dict = {}
    for workload, build in workloads.items():
        pairs: list[tuple[float, float]] = []
        for rep in range(args.repeats):
            order = ("default", "fixed") if rep % 2 == 0 else ("fixed", "default")
            seconds = {}
            for name in order:
                seconds[name] = run_to_completion(engines[name], build(2 * rep + len(seconds)))
            pairs.append((seconds["default"], seconds["fixed"]))
            log(
                f"{workload} #{rep}: default {seconds['default']:.2f} s, fixed "
                f"{seconds['fixed']:.2f} s ({seconds['fixed'] / seconds['default']:.3f})"
            )
        amount = args.frames if workload == "camera" else args.num_chat * args.chat_tokens
        per = 60.0 if workload == "camera" else 1.0
        results[workload] = {
            "pairs_s": pairs,
            "default_per_unit": per * amount / statistics.median(d for d, _ in pairs),
            "fixed_per_unit": per * amount / statistics.median(f for _, f in pairs),
            "unit": "frames/min" if workload == "camera" else "tokens/s",
            "cost": paired_cost(pairs),
        }
        r = results[workload]
        log(
            f"{workload} only: default {r['default_per_unit']:.2f} {r['unit']}, fixed "
            f"{FIXED_BUDGET} tokens {r['fixed_per_unit']:.2f}: the default costs "
            f"{100 * r['cost']:.1f} % (target <= 5 %)"
        )
    save_json(args.out, {"results": results, "args": vars(args)})


if __name__ == "__main__":
    main()
