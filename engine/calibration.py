"""Start-up profile run that seeds the step-cost model with steps of every shape.

An ITL target is only as good as the cost model's prediction for the step shapes it has to
choose between — a handful of decodes plus a few prefill tokens, mostly — and an online fit
learns only the shapes the scheduler already runs. So before serving, the engine runs a
short series of synthetic steps through the real model runner (dummy token ids, real KV
blocks, freed afterwards): prefill chunks of 8 to ``max_num_batched_tokens`` tokens, decodes
of 1 to 16 requests, decodes with small prefill chunks beside them, steps that advance a
synthetic image's encoding, alone and beside decodes, and a few decode and side-chunk shapes
again at ``LONG_CONTEXT`` (what attention costs per key). Each shape runs three times; the two
warm times go to the cost model. Online steps replace these samples
bucket by bucket (see :class:`engine.cost_model.StepCostModel`), so the calibration is a
starting point, not a constant.

Steps are sized by predicted time by default, so every engine start needs this. It is cached
per machine, model, dtype and engine shape (:func:`calibration_key`) under
``$VISION_SERVE_CACHE_DIR`` (default ``~/.cache/vision-serve``): a restart on the same box reuses
it, a new CPU, checkpoint or dtype runs it again. Prefill shapes stop growing once a step takes
``MAX_CALIBRATION_STEP_S``: bigger ones teach the fit nothing new and would cost a large model
minutes on a small CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.cost_model import FEATURES, StepCostModel, StepFeatures
from engine.device import LESSER_CPU_LIBRARY_ENV, cpuinfo_field
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import EncoderJob, ScheduledChunk, Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine

log = logging.getLogger("engine.calibration")

CONTEXT = 64  # tokens each decoding request holds before the decode shapes run
# ... and before the same shapes run again: the context a camera frame's prompt chunks and a
# long chat attend to, so that the fit sees what attention costs (engine/cost_model.py)
LONG_CONTEXT = 1024
LONG_DECODE_BATCHES = (1, 4)
LONG_SIDE_CHUNKS = (1, 4, 12)
GROW_PIECE = 512  # tokens a sequence grows by per (unobserved) step on the way there
PREFILL_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)  # past ~1k tokens the fit extrapolates
DECODE_BATCHES = (1, 2, 4, 8, 16)
# prefill tokens next to 4 decodes: the ITL-target regime (up to 12, the fused kernel's rows)
SIDE_CHUNKS = (1, 2, 4, 8, 12, 16, 32, 64)
MAX_CALIBRATION_STEP_S = 1.5  # prefill shapes stop growing past a step this long
# a synthetic image for the encoder shapes: 32x32 patches (a 448x448 picture's worth)
ENCODER_GRID = (1, 32, 32)
# of the image's work per step: from the few rows a step beside chat gets to several items, so
# the fit can tell the per-item cost from the per-unit one
ENCODER_FRACTIONS = (1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8)
CACHE_VERSION = 7  # bump when what a calibration measures changes


class _Calibrator:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, cost_model: StepCostModel):
        self.runner, self.kv, self.cost_model = runner, kv, cost_model
        self.params = SamplingParams(temperature=0.0)
        self.lengths: dict[str, int] = {}
        self.samples = 0
        self.last_seconds = 0.0
        # (features, step seconds, encoder seconds or None)
        self.recorded: list[tuple[StepFeatures, float, float | None]] = []

    def chunk(self, rid: str, n: int, sample: bool) -> ScheduledChunk:
        start = self.lengths.get(rid, 0)
        positions = torch.arange(start, start + n, dtype=torch.long).unsqueeze(0).expand(3, -1)
        return ScheduledChunk(
            request_id=rid,
            start=start,
            num_tokens=n,
            token_ids=[(start + i) % 100 + 1 for i in range(n)],
            positions=positions,
            block_table=list(self.kv.block_table(rid)),
            image_slices=[],
            sample=sample,
            is_decode=sample and n == 1,
            params=self.params,
            generator=None,
            output_token_ids=[],
        )

    def fits(self, need: dict[str, int]) -> bool:
        blocks = sum(self.kv.blocks_needed(rid, total) for rid, total in need.items())
        return blocks <= self.kv.num_free_blocks

    def step(self, parts: list[tuple[str, int, bool]], observe: bool) -> bool:
        """Run one synthetic step of (request, new tokens, samples?) parts, decodes first."""
        need = {rid: self.lengths.get(rid, 0) + n for rid, n, _ in parts}
        if not self.fits(need):
            return False
        for rid, total in need.items():
            self.kv.allocate(rid, total)
        sched = SchedulerOutput(chunks=[self.chunk(rid, n, sample) for rid, n, sample in parts])
        features = StepFeatures(
            fused_decode_rows=self.runner.fused_decode_rows,
            fused_prefill_rows=self.runner.fused_prefill_rows,
            gemv_rows=self.runner.fused_gemv_rows,
        )
        for c in sched.chunks:
            if c.is_decode:
                features.add_decode(c.start + 1)
            else:
                features.add_chunk(c.start, c.num_tokens)
        t0 = time.perf_counter()
        self.runner.execute(sched)
        seconds = time.perf_counter() - t0
        for rid, total in need.items():
            self.lengths[rid] = total
        self.last_seconds = seconds
        if observe:
            self.observe(features, seconds)
        return True

    def observe(
        self, features: StepFeatures, seconds: float, encoder_s: float | None = None
    ) -> None:
        self.cost_model.observe(features, seconds, encoder_s)
        self.recorded.append((features, seconds, encoder_s))
        self.samples += 1

    def encoder_steps(self, decoders: list[str]) -> None:
        """Steps that advance a synthetic image's encoding, alone and beside decodes: the
        price of encoder work that time-sized steps ration."""
        if getattr(self.runner.model, "vision_impl", "engine") != "engine":
            return  # the transformers tower encodes whole images: nothing to ration
        proj = self.runner.model.vision_tower().hf.patch_embed.proj.weight
        t, h, w = ENCODER_GRID
        pixels = torch.randn(t * h * w, proj[0].numel(), dtype=torch.float32)
        tag = "calib-image"
        self.runner.execute(SchedulerOutput(encoder_jobs=[EncoderJob(tag, pixels, ENCODER_GRID)]))
        job = self.runner.encode_jobs[tag]
        total = job.remaining_cost
        try:
            for fraction in ENCODER_FRACTIONS:
                for parts in ([], [(rid, 1, True) for rid in decoders[:4]]):
                    if job.done():
                        return
                    self.encoder_step(parts, tag, fraction * total)
        finally:
            self.runner.encode_jobs.pop(tag, None)
            self.runner.encoder_outputs.pop(tag, None)

    def encoder_step(self, parts: list[tuple[str, int, bool]], tag: str, units: float) -> None:
        need = {rid: self.lengths.get(rid, 0) + n for rid, n, _ in parts}
        if not self.fits(need):
            return
        for rid, total in need.items():
            self.kv.allocate(rid, total)
        sched = SchedulerOutput(
            chunks=[self.chunk(rid, n, sample) for rid, n, sample in parts],
            encoder_work={tag: units},
        )
        features = StepFeatures(
            fused_decode_rows=self.runner.fused_decode_rows,
            fused_prefill_rows=self.runner.fused_prefill_rows,
            gemv_rows=self.runner.fused_gemv_rows,
        )
        for c in sched.chunks:
            features.add_decode(c.start + 1)
        t0 = time.perf_counter()
        result = self.runner.execute(sched)
        if self.runner.device.type == "cuda":  # no token sampled: nothing waited for the GPU
            torch.cuda.synchronize(self.runner.device)
        seconds = time.perf_counter() - t0
        for rid, total in need.items():
            self.lengths[rid] = total
        features.encoder_units = result.encoder_units
        features.encoder_items = result.encoder_items
        self.observe(features, seconds, result.encoder_work_s)

    def shape(self, build) -> None:
        """One shape three times: a cold run, then two warm ones the cost model learns from
        (one sample a shape let a single noisy step on a shared 2-core machine set a price)."""
        for observe in (False, True, True):
            parts, fresh = build()
            for rid in fresh:  # prefill shapes restart from an empty sequence
                self.release(rid)
            if not self.step(parts, observe):
                return

    def long_context_shapes(
        self, side: list[str], max_num_batched_tokens: int, max_model_len: int | None
    ) -> None:
        """The decode and side-chunk shapes again, every sequence grown to LONG_CONTEXT (or
        what the model and the KV pool hold): their prices per key apart from the prefill
        steps' (engine/cost_model.py, ``decode_attention_units``, ``chunk_keys``)."""
        longest = LONG_CONTEXT if max_model_len is None else min(LONG_CONTEXT, max_model_len)
        target = longest - 2 * max(LONG_SIDE_CHUNKS) * 3  # room for the shapes' own tokens
        if not side or target <= 2 * CONTEXT:
            return
        grown = []
        for rid in [*side, "calib-side"]:
            while self.lengths.get(rid, 0) < target:  # in prompt-sized pieces
                n = min(GROW_PIECE, target - self.lengths.get(rid, 0))
                if not self.step([(rid, n, False)], observe=False):
                    break
            if self.lengths.get(rid, 0) < target:
                break
            grown.append(rid)
        decoders = [rid for rid in grown if rid != "calib-side"]
        for b in LONG_DECODE_BATCHES:
            if b <= len(decoders):
                self.shape(lambda b=b: ([(rid, 1, True) for rid in decoders[:b]], []))
        if "calib-side" not in grown:
            return
        for n in LONG_SIDE_CHUNKS:
            if len(decoders) + n <= max_num_batched_tokens:
                self.shape(
                    lambda n=n: (
                        [(rid, 1, True) for rid in decoders] + [("calib-side", n, False)],
                        [],
                    )
                )

    def release(self, rid: str) -> None:
        self.kv.free(rid)
        self.lengths.pop(rid, None)


def calibrate(
    runner: ModelRunner,
    kv: KVCacheManager,
    cost_model: StepCostModel,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int | None = None,
) -> list[tuple[StepFeatures, float, float | None]]:
    """Seed ``cost_model`` with synthetic steps; returns the (features, step seconds, encoder
    seconds) observed."""
    cal = _Calibrator(runner, kv, cost_model)
    t0 = time.perf_counter()
    try:
        for n in PREFILL_SIZES:
            if n > max_num_batched_tokens:
                break
            cal.shape(lambda n=n: ([("calib-prefill", n, False)], ["calib-prefill"]))
            if cal.last_seconds > MAX_CALIBRATION_STEP_S:
                break
        cal.release("calib-prefill")
        decoders = [f"calib-dec-{i}" for i in range(min(max(DECODE_BATCHES), max_num_seqs))]
        for rid in decoders:  # give each decoder a context, as a real one would have
            if not cal.step([(rid, CONTEXT, False)], observe=False):
                break
        ready = [rid for rid in decoders if rid in cal.lengths]
        for b in DECODE_BATCHES:
            if b <= len(ready):
                cal.shape(lambda b=b: ([(rid, 1, True) for rid in ready[:b]], []))
        side = ready[:4]
        if side:
            cal.step([("calib-side", CONTEXT, False)], observe=False)
            for n in SIDE_CHUNKS:
                if len(side) + n <= max_num_batched_tokens:
                    cal.shape(
                        lambda n=n: (
                            [(rid, 1, True) for rid in side] + [("calib-side", n, False)],
                            [],
                        )
                    )
        cal.encoder_steps(side)
        cal.long_context_shapes(side, max_num_batched_tokens, max_model_len)
    finally:
        for rid in list(cal.lengths):
            cal.release(rid)
    cost_model.refit()
    log.info(
        "cost_model_calibrated samples=%d secs=%.2f coefficients=%s",
        cal.samples,
        time.perf_counter() - t0,
        {k: f"{v:.2e}" for k, v in cost_model.coefficients().items()},
    )
    return cal.recorded


# ---- the per-machine cache ---------------------------------------------------------------------
def cache_dir() -> Path:
    root = os.environ.get("VISION_SERVE_CACHE_DIR") or Path.home() / ".cache" / "vision-serve"
    return Path(root) / "calibration"


def _cpu_name() -> str:
    return cpuinfo_field("model name") or platform.processor()


def _kernels_digest(variant: str | None) -> str | None:
    """The kernel build's sources digest; None where they cannot be read (an installation that
    ships prebuilt modules without them keys by the rest)."""
    if variant is None:
        return None
    from engine.kernels import sources_digest

    try:
        return sources_digest(variant)
    except OSError:
        return None


_LIBRARY_ISA_ENV = sorted({key for env in LESSER_CPU_LIBRARY_ENV.values() for key in env})


def calibration_key(engine: LLMEngine) -> str:
    """What a calibration depends on: the machine (CPU model, ISA torch uses, threads, GPU),
    the model (its config), the dtype and the engine's shape (kernels, item sizes, limits)."""
    args: EngineArgs = engine.args
    device = engine.device
    parts = {
        "version": CACHE_VERSION,
        "features": FEATURES,
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        # oneDNN's and MKL's instruction-set caps (engine.device.LESSER_CPU_LIBRARY_ENV)
        "library_isa": {key: os.environ.get(key) for key in _LIBRARY_ISA_ENV},
        "threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "config": (engine.model_dir / "config.json").read_text(),
        "dtype": str(engine.dtype),
        "quantization": args.quantization,
        # every hardware choice (attention kind, linears, kernels build): a new one is new code
        "platform": engine.platform.describe(),
        # and the kernels' own code: a faster GEMV prices every fused step anew
        "kernels": _kernels_digest(engine.platform.kernel_variant)
        if engine.platform.use_cpu_kernels
        else None,
        "fused_decode_rows": engine.runner.fused_decode_rows,
        "fused_prefill_rows": engine.runner.fused_prefill_rows,
        "gemv_max_rows": engine.runner.gemv_max_rows,
        "weight_prefetch_bytes": engine.runner.weight_prefetch_bytes,
        "encoder_rows_per_item": engine.runner.encoder_rows_per_item,
        "block_size": args.block_size,
        "token_cap": engine.scheduler.config.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def calibrate_cached(
    runner: ModelRunner,
    kv: KVCacheManager,
    cost_model: StepCostModel,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    key: str,
    max_model_len: int | None = None,
) -> None:
    """Seed ``cost_model`` from this machine's cached calibration, or calibrate and cache it."""
    path = cache_dir() / f"{key}.json"
    try:
        samples = json.loads(path.read_text())["samples"]
        for fields, seconds, encoder_s in samples:
            cost_model.observe(StepFeatures(**fields), float(seconds), encoder_s)
        cost_model.refit()
        if cost_model.ready:
            log.info("cost_model_from_cache path=%s samples=%d", path, len(samples))
            return
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no cache yet, or one this code cannot read: measure
    recorded = calibrate(
        runner, kv, cost_model, max_num_batched_tokens, max_num_seqs, max_model_len
    )
    load = _busy_load()
    if load is not None:
        # steps timed while other work held the cores: fine to start from (online steps
        # replace them bucket by bucket), wrong to keep as this machine's figures for good
        log.warning(
            "calibration not cached: the machine was busy (load average %.1f on %d cores); "
            "the next start measures again",
            load,
            os.cpu_count() or 1,
        )
        return
    data = {"samples": [(vars(f), s, e) for f, s, e in recorded]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as exc:  # a read-only home: calibrate again next start
        log.warning("calibration not cached (%s): %s", path, exc)


# a 1-min load average above this many times the core count means other work shared them
BUSY_LOAD_PER_CORE = 1.5


def _busy_load() -> float | None:
    """The load average when it says other processes competed for the cores, else None."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    return load if load > BUSY_LOAD_PER_CORE * (os.cpu_count() or 1) else None


def log_step_policy(scheduler: Scheduler, args: EngineArgs) -> None:
    """State at start-up how steps will be sized and why, in numbers."""
    cfg = scheduler.config
    limits = cfg.limits
    if not limits.time_sized:
        log.info(
            "step_policy mode=fixed-tokens max_num_batched_tokens=%d (set by the user; no time "
            "limit: a step takes as long as its tokens do)",
            cfg.max_num_batched_tokens,
        )
        return
    budget = scheduler.new_budget()
    budget.add_decode(CONTEXT)
    decode_s = budget.predicted_s
    eager_s = scheduler.cost_model.predict(dataclasses.replace(budget.features, force_eager=True))
    budget.open_prefill(interactive_decoding=True)
    chat_prompt = budget.fit_chunk(CONTEXT, cfg.max_num_batched_tokens, interactive=True)
    budget.restrict_to_itl()  # what a camera prompt gets beside the same stream
    beside_chat = budget.fit_chunk(CONTEXT, cfg.max_num_batched_tokens)
    batch_only = scheduler.new_budget()
    batch_only.open_prefill(interactive_decoding=False)
    bound = batch_only.step_bound_s()
    encoder_bound = batch_only.encoder_step_bound_s()
    long_bound = batch_only.interruptible_bound_s()
    log.info(
        "step_policy mode=time-sized token_cap=%d itl_target=%s (%s ms with one chat stream) "
        "max_step=%s (%s ms; encoder-only steps %s ms) decode_step=%.1f ms (eager forward "
        "%.1f ms; fused kernel rows: "
        "%d decode-only, %d with prompt tokens) prefill=%.2f ms/token => ~%d camera prompt "
        "tokens beside one chat stream (another chat's prompt ~%d), up to ~%d per batch-only "
        "step; why: an arriving chat request waits at most one step, and chat streams keep "
        "their ITL while camera work fills what they leave; with no chat in the engine, "
        "interruptible steps up to %s ms (given up at half-layer safe points for an arriving chat)",
        cfg.max_num_batched_tokens,
        "off" if limits.target_itl_s is None else limits.target_itl_s,
        "-" if budget.itl_target_s is None else f"{budget.itl_target_s * 1e3:.1f}",
        "off" if limits.max_step_s is None else limits.max_step_s,
        "-" if bound is None else f"{bound * 1e3:.1f}",
        "-" if math.isinf(encoder_bound) else f"{encoder_bound * 1e3:.1f}",
        decode_s * 1e3,
        eager_s * 1e3,
        cfg.fused_decode_rows,
        cfg.fused_prefill_rows,
        scheduler.cost_model.compute_bound_prefill_s() * 1e3,
        beside_chat,
        chat_prompt,
        batch_only.fit_chunk(0, cfg.max_num_batched_tokens),
        "off" if long_bound is None else f"{long_bound * 1e3:.0f}",
    )
