"""Start-up profile run that seeds the step-cost model with steps of every shape.

An ITL target is only as good as the cost model's prediction for the step shapes it has to
choose between — a handful of decodes plus a few prefill tokens, mostly — and an online fit
learns only the shapes the scheduler already runs. So before serving, the engine runs a
short series of synthetic steps through the real model runner (dummy token ids, real KV
blocks, freed afterwards): prefill chunks of 8 to ``max_num_batched_tokens`` tokens, decodes
of 1 to 16 requests, and decodes with small prefill chunks beside them. Each shape runs
twice; the second, warm, time goes to the cost model. Online steps replace these samples
bucket by bucket (see :class:`engine.cost_model.StepCostModel`), so the calibration is a
starting point, not a constant.

Costs: well under a second on the tiny test checkpoints, ~3 s on ``bench``.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.cost_model import StepCostModel, StepFeatures, chunk_attention_units
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, SchedulerOutput

log = logging.getLogger("engine.calibration")

CONTEXT = 64  # tokens each decoding request holds before the decode shapes run
PREFILL_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)  # past ~1k tokens the fit extrapolates
DECODE_BATCHES = (1, 2, 4, 8, 16)
SIDE_CHUNKS = (2, 4, 8, 16, 32, 64)  # prefill tokens next to 4 decodes: the ITL-target regime


class _Calibrator:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, cost_model: StepCostModel):
        self.runner, self.kv, self.cost_model = runner, kv, cost_model
        self.params = SamplingParams(temperature=0.0)
        self.lengths: dict[str, int] = {}
        self.samples = 0

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
        features = StepFeatures(fused_decode_rows=self.runner.fused_decode_rows)
        for c in sched.chunks:
            if c.is_decode:
                features.decode_tokens += 1
                features.attention_units += c.start + 1
            else:
                features.prefill_tokens += c.num_tokens
                features.attention_units += chunk_attention_units(c.start, c.num_tokens)
        t0 = time.perf_counter()
        self.runner.execute(sched)
        seconds = time.perf_counter() - t0
        for rid, total in need.items():
            self.lengths[rid] = total
        if observe:
            self.cost_model.observe(features, seconds)
            self.samples += 1
        return True

    def shape(self, build) -> None:
        """One shape twice: a cold run, then a warm one the cost model learns from."""
        for observe in (False, True):
            parts, fresh = build()
            for rid in fresh:  # prefill shapes restart from an empty sequence
                self.release(rid)
            if not self.step(parts, observe):
                return

    def release(self, rid: str) -> None:
        self.kv.free(rid)
        self.lengths.pop(rid, None)


def calibrate(
    runner: ModelRunner,
    kv: KVCacheManager,
    cost_model: StepCostModel,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> int:
    """Seed ``cost_model`` with synthetic steps; returns how many it observed."""
    cal = _Calibrator(runner, kv, cost_model)
    t0 = time.perf_counter()
    try:
        for n in PREFILL_SIZES:
            if n <= max_num_batched_tokens:
                cal.shape(lambda n=n: ([("calib-prefill", n, False)], ["calib-prefill"]))
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
    finally:
        for rid in list(cal.lengths):
            cal.release(rid)
    log.info(
        "cost_model_calibrated samples=%d secs=%.2f coefficients=%s",
        cal.samples,
        time.perf_counter() - t0,
        {k: f"{v:.2e}" for k, v in cost_model.coefficients().items()},
    )
    return cal.samples
