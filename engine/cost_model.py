"""An online model of step time, learnt from the steps the engine actually ran.

    step_s ≈ fixed + l·lm_forward + a·prefill_tokens + b·decode_tokens
             + Σ_k h_k·max(0, rows − k) + c·attention_units + c_d·decode_attention_units
             + c_k·chunk_keys + d·encoder_units
             + i·encoder_items + e·eager_forward + g·past_gemv + m·mixed_step
             + p·mixed_prefill_tokens

``rows`` are all new tokens of the step (decode and prefill): the weights are read once per
step whatever the row count, so up to the machine's ridge point (a few rows on a CPU, hundreds
on a GPU) a row is nearly free and past it each row costs its FLOPs. A plain linear model
prices every prefill token at the compute-bound rate it learns from big chunks, which under an
ITL target grants a few tokens per step when a dozen ride along for free. The hinges at
``ROW_KNOTS`` let the fit learn that roofline shape (convex, since no coefficient may be
negative) without knowing the machine.

``lm_forward`` is 1 for a step that runs the language model at all: streaming its weights is
a floor that every step with tokens pays (50-80 ms for ``bench`` in fp32 on a 2-core AVX2
EPYC) and a step that only advances image encoding does not. Without it the fit spread that
floor over the encoder's price (priced 5x too cheap there) and over every step.

``eager_forward`` is 1 for a step whose decoder forward runs the eager PyTorch path although
the engine also has the fused CPU kernel (engine/kernels): a step with more decodes than the
kernel takes, or with prompt tokens and more rows in all than the kernel's GEMV takes
(``fused_prefill_rows``), pays the eager path's per-op overhead (and, in bf16 on CPUs without
bf16 arithmetic, the widening of every weight) that a fused step does not. Without the kernel
it is always 0.

``past_gemv`` is 1 for a step the fused kernel runs with more rows than its own GEMV takes
(``gemv_rows``, engine/platform.py): past them its linears call oneDNN's packed GEMM, whose
small-row floor is a jump, not a slope. On a 2-core AMX Xeon (bench, bf16, in turns) 4 chat
decodes plus 12 prompt rows ran 22.6 ms and plus 13 ran 32.8 (decodes alone 14.3). No hinge
can price a jump: without the feature the fit spread it over the mixed-step prices, which
then starved every small chunk beside chat (a 1-token chunk predicted 28 ms against 23), and
the starved prompts went in forced 16-token blocks that paid the jump every time (51 ms
steps against a 33 ms target, prompt tokens at 1.4 ms each against 0.3 alone).

``mixed_step`` is 1 for a step with both prompt tokens and decodes, and
``mixed_prefill_tokens`` its prompt tokens: a prompt row beside decodes costs more than one
alone (not pinned down; likely the decodes' rows taking the chunk's linears past the cheap
part of the fused GEMV, and the chunk's own attention pass per layer). Calibrated on a
2-core AMX Xeon, 4 decodes plus 4, 8, 16 and 32 prompt tokens ran 15.5, 17, 19.6 and 26 ms
against 13.0, 14.0, 16.1 and 20.7 predicted without them (14.2, 16.1, 20.0 and 27.8 with
them), the prompt-only and decode-only steps of the same fit within a few percent either
way: the chat ITL target was overshot by exactly the steps that carry camera rows beside
chat, whose tail set the chat ITL p99 in the server.

``attention_units`` is the query×key work of the step (each new token times the context it
attends to, in thousands); ``decode_attention_units`` the part of it decode rows do, and
``chunk_keys`` the keys the step's prompt chunks attend to (each chunk's context, once). A
prompt chunk of a hundred rows or more attends through a flash kernel, cheap per query-key
pair; a decode row walks its paged keys alone, and a small chunk (the camera's few rows beside
chat) pays for its keys about once whatever its rows (a block of rows, on AMX in one tile
product). One price per query-key pair fitted 0 on a 2-core AMX Xeon, while 4 decodes at
1,024 keys ran 18.7 / 18.1 ms against 16.4 / 15.1 at 64: the fit had seen decodes at one
context only, and the prefill steps' quadratic attention, cheap per pair, set the price.
Calibration now runs decodes and small chunks at a long context too.

``encoder_units`` is ``encoder_units`` the vision-tower work run in the step (in
thousands of the tower's patch-block units, see ``engine/models/vision_encoder.py``).
``encoder_items`` counts the vision work items the step ran: each costs more than its FLOPs
(on a 2-core AVX2 EPYC beside 4 decodes, a 16-row piece of a 640x480 frame's attention + MLP
took 5 ms, 2-3 ms more than its FLOPs at full speed, mostly small-row matmuls). Priced by FLOPs
alone, steps given a few ms of encoder work beside chat ran 1-5 ms over their ITL target at
the median, 7-21 ms at p99 (in-process runs of the same workload).

The two encoder prices are fitted apart, on the encoder's own measured time (the runner times
it): a few ms of encoder work sit inside a step whose decode part varies by as much on a
shared machine. A step that reports its encoder time teaches the rest of the model its time
without it. The
coefficients are refit by least squares over recent steps of every kind (see
:class:`StepCostModel`), so they track the machine, the model and the dtype without hand
tuning; the scheduler asks the model how many prefill tokens fit under an inter-token-latency
target. ``engine/calibration.py`` seeds it at start-up with steps of every shape.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

ROW_KNOTS = (8, 32, 128, 512)
FEATURES = (
    "fixed",
    "prefill_tokens",
    "decode_tokens",
    *(f"rows_over_{k}" for k in ROW_KNOTS),
    "attention_kunits",
    "decode_attention_kunits",
    "chunk_keys_kunits",
    "encoder_kunits",
    "encoder_items",
    "eager_forward",
    "past_gemv",
    "lm_forward",
    "mixed_step",
    "mixed_prefill_tokens",
)


@dataclass
class StepFeatures:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    attention_units: float = 0.0  # sum over new tokens of the context length they attend to
    encoder_units: float = 0.0  # vision-tower work (patch-block units)
    encoder_items: int = 0  # vision work items that work ran in (a fixed cost each)
    fused_decode_rows: int = 0  # the engine's fused-decode row limit (0: no fused kernel)
    force_eager: bool = False  # price the step as an eager forward whatever its shape
    # steps with prompt tokens run the fused kernel up to this many rows in all (0: never)
    fused_prefill_rows: int = 0
    # the fused kernel's own GEMV takes up to this many rows, oneDNN's GEMM more (0: no switch)
    gemv_rows: int = 0
    decode_attention_units: float = 0.0  # the part of attention_units decode rows do
    chunk_keys: float = 0.0  # sum over prompt chunks of the context each attends to

    @property
    def eager_forward(self) -> bool:
        if not self.fused_decode_rows:
            return False
        if self.force_eager:
            return True
        if self.prefill_tokens > 0:
            return self.prefill_tokens + self.decode_tokens > self.fused_prefill_rows
        return self.decode_tokens > self.fused_decode_rows

    @property
    def past_gemv(self) -> bool:
        """The fused kernel runs this step's linears in oneDNN's GEMM, not its own GEMV."""
        rows = self.prefill_tokens + self.decode_tokens
        return bool(self.fused_decode_rows) and 0 < self.gemv_rows < rows and not self.eager_forward

    def vector(self) -> np.ndarray:
        rows = self.prefill_tokens + self.decode_tokens
        return np.array(
            [
                1.0,
                self.prefill_tokens,
                self.decode_tokens,
                *(max(0, rows - k) for k in ROW_KNOTS),
                self.attention_units / 1e3,
                self.decode_attention_units / 1e3,
                self.chunk_keys / 1e3,
                self.encoder_units / 1e3,
                self.encoder_items,
                float(self.eager_forward),
                float(self.past_gemv),
                float(rows > 0),
                float(self.prefill_tokens > 0 and self.decode_tokens > 0),
                self.prefill_tokens if self.decode_tokens > 0 else 0,
            ]
        )

    def plus(self, other: StepFeatures) -> StepFeatures:
        return StepFeatures(
            self.prefill_tokens + other.prefill_tokens,
            self.decode_tokens + other.decode_tokens,
            self.attention_units + other.attention_units,
            self.encoder_units + other.encoder_units,
            self.encoder_items + other.encoder_items,
            max(self.fused_decode_rows, other.fused_decode_rows),
            self.force_eager or other.force_eager,
            max(self.fused_prefill_rows, other.fused_prefill_rows),
            max(self.gemv_rows, other.gemv_rows),
            self.decode_attention_units + other.decode_attention_units,
            self.chunk_keys + other.chunk_keys,
        )

    def add_decode(self, context_len: int) -> None:
        """One decode row attending to ``context_len`` keys."""
        self.decode_tokens += 1
        self.attention_units += context_len
        self.decode_attention_units += context_len

    def remove_decode(self, context_len: int) -> None:
        """Take back an :meth:`add_decode`."""
        self.decode_tokens -= 1
        self.attention_units -= context_len
        self.decode_attention_units -= context_len

    def add_chunk(self, start: int, num_tokens: int) -> None:
        """A prompt chunk of tokens [start, start + num_tokens)."""
        self.prefill_tokens += num_tokens
        self.attention_units += chunk_attention_units(start, num_tokens)
        self.chunk_keys += start + num_tokens


def chunk_attention_units(start: int, num_tokens: int) -> float:
    """Query-key pairs of a causal chunk covering tokens [start, start + num_tokens)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) / 2


class StepCostModel:
    """Least squares over recent steps, kept per *kind* of step.

        A plain sliding window forgets: after a minute of 4 decodes + 2 prefill tokens per step
        it holds nothing else, the fit becomes degenerate (fixed cost and per-decode cost
        indistinguishable, a per-token price read from noise) and the scheduler, trusting it,
        never tries the step shapes that would correct it. So samples are kept per bucket (row
        count on a log2 scale, with or without encoder work, pure or mixed, fused or eager forward,
        the kernel's GEMV or past it),
    ``per_bucket`` each:
        every regime the engine has seen — including the calibration run at start-up — stays in
        the fit until newer steps of the same kind replace it.
    """

    def __init__(
        self,
        per_bucket: int = 32,
        refit_every: int = 8,
        min_samples: int = 8,
        coefficients: dict[str, float] | None = None,
        refit_interval_s: float = 0.1,
    ) -> None:
        self.buckets: dict[tuple, deque[tuple[np.ndarray, float]]] = {}
        self.per_bucket = per_bucket
        self.refit_every = refit_every
        # and at most this often: a fit over every bucket costs ~0.5-0.8 ms, which every 8th
        # step made ~0.1 ms of each 3-6 ms decode step (scratch timing, int8 and bf16 bench
        # decode steps on a 2-core Zen 4); prices that settle in a tenth of a second lose nothing
        self.refit_interval_s = refit_interval_s
        self._last_fit = float("-inf")
        self.min_samples = min_samples
        self.since_fit = 0
        self.num_samples = 0
        self.coef: np.ndarray | None = None
        # (kunits, items, encoder seconds) of recent steps that timed their encoder work,
        # kept per item count so that steps of one shape cannot crowd the others out
        self.encoder_samples: dict[int, deque[tuple[float, int, float]]] = {}
        self.fixed = coefficients is not None  # a synthetic model (tests) never refits
        if coefficients is not None:
            self.coef = np.array([coefficients.get(name, 0.0) for name in FEATURES])

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def observe(
        self, features: StepFeatures, seconds: float, encoder_s: float | None = None
    ) -> None:
        """One step's time. ``encoder_s``: the part of it the encoder work took, when timed:
        the encoder prices are then fitted on it and the rest of the model on the remainder."""
        if self.fixed:
            return
        if encoder_s is not None and features.encoder_items > 0:
            key = min(features.encoder_items, 4)
            kept = self.encoder_samples.setdefault(key, deque(maxlen=self.per_bucket))
            kept.append((features.encoder_units / 1e3, features.encoder_items, encoder_s))
            features = dataclasses.replace(features, encoder_units=0.0, encoder_items=0)
            seconds = max(seconds - encoder_s, 0.0)
        bucket = self.buckets.setdefault(_bucket(features), deque(maxlen=self.per_bucket))
        self.num_samples += len(bucket) < self.per_bucket
        bucket.append((features.vector(), seconds))
        self.since_fit += 1
        if self.num_samples >= self.min_samples and (
            self.coef is None
            or (
                self.since_fit >= self.refit_every
                and time.monotonic() - self._last_fit >= self.refit_interval_s
            )
        ):
            self._fit()

    def refit(self) -> None:
        """Fit now on every sample held (after a batch of observations, e.g. a cached
        calibration, whose last few would otherwise wait for ``refit_every`` more)."""
        if self.num_samples and not self.fixed:
            self._fit()

    def _fit(self) -> None:
        samples = [sample for bucket in self.buckets.values() for sample in bucket]
        # relative error, not absolute: the scheduler cares about a 50 ms decode step as much
        # as a 2 s prefill, and absolute least squares lets the long steps set every price
        y = np.array([t for _, t in samples])
        coef = _nonnegative_lstsq(np.stack([v for v, _ in samples]), y)
        encoder = [s for kept in self.encoder_samples.values() for s in kept]
        if len(encoder) >= self.min_samples:
            units_items = np.array([(u, n) for u, n, _ in encoder], dtype=float)
            prices = _nonnegative_lstsq(units_items, np.array([t for *_, t in encoder]))
            coef[FEATURES.index("encoder_kunits")] = prices[0]
            coef[FEATURES.index("encoder_items")] = prices[1]
        self.coef = coef
        self.since_fit = 0
        self._last_fit = time.monotonic()

    def seconds_per(self, feature: str) -> float:
        """The learnt marginal cost of one unit of a feature (0 until fitted)."""
        if self.coef is None:
            return 0.0
        scale = 1e-3 if feature in ("attention_units", "encoder_units") else 1.0
        return float(self.coef[FEATURES.index(feature.replace("_units", "_kunits"))]) * scale

    def compute_bound_prefill_s(self) -> float:
        """Seconds per prefill token past every knee: the rate of big chunks, the exchange
        rate for encoder work (which never rides along for free)."""
        if self.coef is None:
            return 0.0
        return self.seconds_per("prefill_tokens") + sum(
            float(self.coef[FEATURES.index(f"rows_over_{k}")]) for k in ROW_KNOTS
        )

    def predict(self, features: StepFeatures) -> float:
        if self.coef is None:
            return 0.0
        return float(features.vector() @ self.coef)

    def coefficients(self) -> dict[str, float]:
        if self.coef is None:
            return {}
        return dict(zip(FEATURES, (float(c) for c in self.coef), strict=True))


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative error with no negative coefficient (a cheap NNLS: fit, drop
    the features that came out negative, refit): a negative cost per token would let the
    scheduler promise time it does not have."""
    weight = 1.0 / np.maximum(y, 1e-4)
    x, y = x * weight[:, None], y * weight
    active = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        coef = np.zeros(x.shape[1])
        coef[active] = sol
        negative = (coef < 0) & active
        if not negative.any():
            break
        active &= ~negative
    return coef


def _bucket(features: StepFeatures) -> tuple[int, bool, bool, bool, bool]:
    rows = features.prefill_tokens + features.decode_tokens
    mixed = features.prefill_tokens > 0 and features.decode_tokens > 0
    return (
        min(rows, 1 << 16).bit_length(),
        features.encoder_units > 0,
        mixed,
        features.eager_forward,
        features.past_gemv,
    )
