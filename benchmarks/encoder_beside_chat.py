"""Camera frames encoded beside chat streams, in-process: do the steps hold their target, and
how much encoder work does the time chat leaves buy?

An engine built as the server builds it (steps sized by time) decodes ``--num-chat`` chat
streams; after ``--warm-steps`` decode-only steps, ``--frames`` camera frames (``priority:
batch``) arrive ``--frame-gap-steps`` steps apart, and the run goes on for ``--steps`` more.
No HTTP, no client on the same cores: what is left is the scheduler, the cost model and the
work itself. Per step with encoder work beside all chat streams:

* the step's time against the ITL target it was sized for, and against the cost model's
  prediction (``overshoot`` = actual - predicted): the chat ITL tail comes from here;
* encoder work done (patch-block units) per second of step time over the decode-only step
  (``units/extra s``; the decode-only step measured before the frames and again after them,
  since the chat contexts grow through the run and a decode step with them), and the
  encoder's own ms per unit against a whole frame encoded alone (``slice efficiency``):
  what the camera share (``benchmarks.interactive_first``) loses to cutting frames into
  step-sized pieces;
* where that loss sits, item kind by item kind (``item_prices``): each kind's items run
  beside chat fitted as a fixed cost per item plus a cost per unit, against the same kind's
  price in the whole-frame encode. Session 30 on a 2-core AVX2 EPYC (three runs): the
  per-unit slopes matched the whole frame's (19-35 against 21-34 us), the fixed costs did not
  -- 1.6-2.1 ms an MLP piece, 0.7-1.3 a qkv piece, 0.4-0.9 an attention piece, on ~3-4 ms
  pieces (benchmarks/README.md, session 30) -- and the first matmul of a piece ran
  at half the speed of the same call repeated (its weights and inputs evicted by the decode
  step before it).

    python -m benchmarks.encoder_beside_chat [--num-chat 4] [--frames 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import (
    bench_checkpoint,
    camera_frame,
    checkpoint_args,
    log,
    save_json,
    setup_env,
)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _ItemTimer:
    """Times every vision work item run, with its kind, rows and price in units.

    Wraps ``VisionEncodeJob._run`` for the benchmark's lifetime (a measurement hook, not an
    engine feature: the step trace keeps per-step totals only). ``beside_chat`` is set by the
    step recorder for steps that carry chat decodes."""

    def __init__(self) -> None:
        from engine.models.vision_encoder import VisionEncodeJob

        self.items: list[dict] = []
        self.beside_chat = False
        self._cls, self._run = VisionEncodeJob, VisionEncodeJob._run
        timer = self

        def timed_run(job, item) -> None:
            t = time.perf_counter()
            timer._run(job, item)
            timer.items.append(
                {
                    "kind": item.kind,
                    "rows": item.end - item.start,
                    "units": item.cost,
                    "s": time.perf_counter() - t,
                    "beside_chat": timer.beside_chat,
                }
            )

        VisionEncodeJob._run = timed_run

    def close(self) -> None:
        self._cls._run = self._run


def item_prices(items: list[dict], whole: list[dict]) -> dict[str, dict]:
    """Per item kind: the items run beside chat fitted as ``fixed_ms`` + ``us_per_unit`` x
    units (least squares; a single size gives no fit), against ``whole_us_per_unit`` of the
    same kind in the whole-frame encode. The fixed cost is what cutting a frame into pieces
    adds per piece; the slope is the work's own rate beside chat."""
    import numpy as np

    out: dict[str, dict] = {}
    for kind in sorted({i["kind"] for i in items}):
        mine = [i for i in items if i["kind"] == kind]
        units = np.array([i["units"] for i in mine])
        secs = np.array([i["s"] for i in mine])
        row: dict = {
            "items": len(mine),
            "units": float(units.sum()),
            "us_per_unit": 1e6 * float(secs.sum() / units.sum()),
            "rows_p50": float(np.median([i["rows"] for i in mine])),
        }
        if len(mine) >= 3 and np.ptp(units) > 0:
            design = np.vstack([np.ones_like(units), units]).T
            (fixed, slope), *_ = np.linalg.lstsq(design, secs, rcond=None)
            row["fit_fixed_ms"], row["fit_us_per_unit"] = 1e3 * fixed, 1e6 * slope
        ref = [i for i in whole if i["kind"] == kind]
        if ref:
            row["whole_us_per_unit"] = 1e6 * sum(i["s"] for i in ref) / sum(i["units"] for i in ref)
        out[kind] = row
    return out


class _StepRecorder:
    """Wraps the scheduler's and the runner's step calls; one record per engine step."""

    def __init__(self, engine, items: _ItemTimer | None = None) -> None:
        self.engine = engine
        self.items = items
        self.records: list[dict] = []
        self._current: dict = {}
        self._schedule, self._execute = engine.scheduler.schedule, engine.runner.execute
        engine.scheduler.schedule = self._on_schedule
        engine.runner.execute = self._on_execute

    def _on_schedule(self):
        out = self._schedule()
        if self.items is not None:
            self.items.beside_chat = bool(out.interactive_decodes)
        self._current.update(
            predicted_s=out.predicted_s,
            target_s=out.target_s,
            decodes=out.num_decode_tokens,
            prefill_tokens=out.num_prefill_tokens,
        )
        return out

    def _on_execute(self, sched):
        result = self._execute(sched)
        self._current.update(
            encoder_units=result.encoder_units,
            encoder_items=result.encoder_items,
            encoder_s=result.encoder_work_s,
        )
        return result

    def step(self) -> None:
        self._current = {"encoder_units": 0.0, "encoder_items": 0, "encoder_s": 0.0}
        t = time.perf_counter()
        self.engine.step()
        self._current["step_s"] = time.perf_counter() - t
        self.records.append(self._current)


def frame_request(width: int, height: int, seed: int) -> dict:
    return {
        "prompt": "<|vision_start|><|image_pad|><|vision_end|>Camera: who is in view?",
        "multi_modal_data": {"image": camera_frame(width, height, seed)},
    }


def whole_frame_ms_per_unit(engine, width: int, height: int) -> float:
    """The encoder's price per unit for one frame encoded whole, nothing beside it."""
    import torch

    image = engine.process_inputs(frame_request(width, height, seed=10_000)).images[0]
    tower = engine.model.vision_tower(None)
    grid = torch.tensor([image.grid_thw])
    tower.encode(image.pixel_values, grid)  # warm
    t = time.perf_counter()
    job = tower.job(image.pixel_values, grid)
    units = job.total_cost
    while not job.done():
        job.advance(float("inf"))
    return 1e3 * (time.perf_counter() - t) / units


def summarise(records: list[dict], num_chat: int, decode_only_s: float) -> dict:
    mixed = [r for r in records if r["decodes"] == num_chat and r["encoder_items"] > 0]
    if not mixed:
        raise SystemExit("no step carried encoder work beside the chat streams")
    steps = [1e3 * r["step_s"] for r in mixed]
    over = [1e3 * (r["step_s"] - r["predicted_s"]) for r in mixed if r["predicted_s"]]
    units = sum(r["encoder_units"] for r in mixed)
    encoder_s = sum(r["encoder_s"] for r in mixed)
    extra_s = sum(r["step_s"] - decode_only_s for r in mixed)
    return {
        "steps": len(mixed),
        "decode_only_ms": 1e3 * decode_only_s,
        "target_ms_median": 1e3 * statistics.median(r["target_s"] for r in mixed if r["target_s"]),
        "step_ms": {q: _quantile(steps, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        | {"max": max(steps)},
        "overshoot_ms": {
            q: _quantile(over, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
        },
        "encoder_units": units,
        "encoder_items": sum(r["encoder_items"] for r in mixed),
        "encoder_ms_per_unit": 1e3 * encoder_s / units,
        "units_per_extra_s": units / extra_s if extra_s > 0 else float("inf"),
    }


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(description=__doc__)
    checkpoint_args(ap, dtype="auto")
    ap.add_argument("--num-chat", type=int, default=4)
    ap.add_argument("--frames", type=int, default=3)
    ap.add_argument("--image-size", default="640x480")
    ap.add_argument("--warm-steps", type=int, default=60, help="decode-only steps first")
    ap.add_argument("--frame-gap-steps", type=int, default=150)
    ap.add_argument("--steps", type=int, default=600, help="steps after the last frame")
    ap.add_argument("--out", default="encoder_beside_chat.json")
    args = ap.parse_args()

    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    width, height = (int(v) for v in args.image_size.split("x"))
    model = bench_checkpoint(args.family, args.model)
    engine = LLMEngine(EngineArgs(model=str(model), dtype=args.dtype, cpu_kernels=args.cpu_kernels))
    timer = _ItemTimer()
    whole = whole_frame_ms_per_unit(engine, width, height)
    whole_items, timer.items = timer.items, []
    recorder = _StepRecorder(engine, timer)
    engine.add_request("warm", frame_request(width, height, 999), SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        recorder.step()
    prompt_len = 40
    chat = SamplingParams(
        temperature=0, max_tokens=engine.max_model_len - prompt_len, ignore_eos=True
    )  # streams that outlast the run (a finished one would leave its slot empty)
    for i in range(args.num_chat):
        prompt = {"prompt_token_ids": list(range(100 + i, 100 + i + prompt_len))}
        engine.add_request(f"chat-{i}", prompt, chat, priority="interactive")
    recorder.records.clear()
    for _ in range(args.warm_steps):
        recorder.step()
    decode_only = [r["step_s"] for r in recorder.records[args.warm_steps // 4 :]]
    frame = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for k in range(args.frames):
        request = frame_request(width, height, seed=k + 1)
        engine.add_request(f"frame-{k}", request, frame, priority="batch")
        for _ in range(args.frame_gap_steps):
            recorder.step()
    for _ in range(args.steps):
        recorder.step()
    # the chat contexts grew by a token a step since the warm phase, and a decode step's time
    # grows with its context: the decode-only reference is the mean of before and after
    for k in range(args.frames):
        engine.abort(f"frame-{k}")
    mark = len(recorder.records)
    for _ in range(args.warm_steps):
        recorder.step()
    after = [r["step_s"] for r in recorder.records[mark + args.warm_steps // 4 :]]
    reference = (statistics.median(decode_only) + statistics.median(after)) / 2
    summary = summarise(recorder.records[:mark], args.num_chat, reference)
    summary["decode_only_ms_before_after"] = [
        1e3 * statistics.median(decode_only),
        1e3 * statistics.median(after),
    ]
    summary["whole_frame_ms_per_unit"] = whole
    summary["slice_efficiency"] = whole / summary["encoder_ms_per_unit"]
    summary["cost_model"] = engine.scheduler.cost_model.coefficients()
    timer.close()
    summary["item_prices"] = item_prices([i for i in timer.items if i["beside_chat"]], whole_items)
    s, o = summary["step_ms"], summary["overshoot_ms"]
    log(
        f"{summary['steps']} steps with encoder work beside {args.num_chat} chat streams: "
        f"step p50/p90/p99 {s['p50']:.1f}/{s['p90']:.1f}/{s['p99']:.1f} ms (max {s['max']:.1f}) "
        f"against a target of {summary['target_ms_median']:.1f} (decode-only "
        f"{summary['decode_only_ms']:.1f}); over the prediction p50/p90/p99 "
        f"{o['p50']:.1f}/{o['p90']:.1f}/{o['p99']:.1f} ms"
    )
    log(
        f"encoder: {summary['encoder_units']:.0f} units in {summary['encoder_items']} items, "
        f"{summary['encoder_ms_per_unit']:.4f} ms/unit (whole frame alone {whole:.4f}: slice "
        f"efficiency {summary['slice_efficiency']:.2f}); {summary['units_per_extra_s']:.0f} units "
        f"per second of step time over the decode-only step"
    )
    for kind, row in summary["item_prices"].items():
        fit = (
            f"fixed {row['fit_fixed_ms']:.2f} ms + {row['fit_us_per_unit']:.1f} us/unit"
            if "fit_fixed_ms" in row
            else "no fit"
        )
        log(
            f"  {kind:>5} beside chat: {row['items']} items, {row['us_per_unit']:.1f} us/unit "
            f"({fit}; rows p50 {row['rows_p50']:.0f}); whole frame "
            f"{row.get('whole_us_per_unit', float('nan')):.1f} us/unit"
        )
    save_json(args.out, {"summary": summary, "steps": recorder.records, "args": vars(args)})


if __name__ == "__main__":
    main()
