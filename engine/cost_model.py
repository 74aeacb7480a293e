"""An online model of step time, learnt from the steps the engine actually ran.

    step_s ≈ fixed + a·prefill_tokens + b·decode_tokens + c·attention_units + d·encoder_units

``attention_units`` is the query×key work of the step (each new token times the context it
attends to, in thousands) and ``encoder_units`` the vision-tower work run in the step (in
thousands of the tower's patch-block units, see ``engine/models/vision_encoder.py``). The
coefficients are refit by least squares over a sliding window of recent steps, so they track
the machine, the model and the dtype without hand tuning; the scheduler asks the model how
many prefill tokens fit under an inter-token-latency target.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

FEATURES = ("fixed", "prefill_tokens", "decode_tokens", "attention_kunits", "encoder_kunits")


@dataclass
class StepFeatures:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    attention_units: float = 0.0  # sum over new tokens of the context length they attend to
    encoder_units: float = 0.0  # vision-tower work (patch-block units)

    def vector(self) -> np.ndarray:
        return np.array(
            [
                1.0,
                self.prefill_tokens,
                self.decode_tokens,
                self.attention_units / 1e3,
                self.encoder_units / 1e3,
            ]
        )

    def plus(self, other: StepFeatures) -> StepFeatures:
        return StepFeatures(
            self.prefill_tokens + other.prefill_tokens,
            self.decode_tokens + other.decode_tokens,
            self.attention_units + other.attention_units,
            self.encoder_units + other.encoder_units,
        )


def chunk_attention_units(start: int, num_tokens: int) -> float:
    """Query-key pairs of a causal chunk covering tokens [start, start + num_tokens)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) / 2


class StepCostModel:
    def __init__(
        self,
        window: int = 512,
        refit_every: int = 8,
        min_samples: int = 8,
        coefficients: dict[str, float] | None = None,
    ) -> None:
        self.window: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self.refit_every = refit_every
        self.min_samples = min_samples
        self.since_fit = 0
        self.coef: np.ndarray | None = None
        self.fixed = coefficients is not None  # a synthetic model (tests) never refits
        if coefficients is not None:
            self.coef = np.array([coefficients.get(name, 0.0) for name in FEATURES])

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def observe(self, features: StepFeatures, seconds: float) -> None:
        if self.fixed:
            return
        self.window.append((features.vector(), seconds))
        self.since_fit += 1
        if len(self.window) >= self.min_samples and (
            self.coef is None or self.since_fit >= self.refit_every
        ):
            self._fit()

    def _fit(self) -> None:
        x = np.stack([v for v, _ in self.window])
        y = np.array([t for _, t in self.window])
        active = np.ones(x.shape[1], dtype=bool)
        coef = np.zeros(x.shape[1])
        # least squares, then drop features that came out negative and refit (a cheap NNLS):
        # a negative cost per token would let the scheduler promise time it does not have
        for _ in range(x.shape[1]):
            sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            coef = np.zeros(x.shape[1])
            coef[active] = sol
            negative = (coef < 0) & active
            if not negative.any():
                break
            active &= ~negative
        self.coef = coef
        self.since_fit = 0

    def seconds_per(self, feature: str) -> float:
        """The learnt marginal cost of one unit of a feature (0 until fitted)."""
        if self.coef is None:
            return 0.0
        scale = 1e-3 if feature in ("attention_units", "encoder_units") else 1.0
        return float(self.coef[FEATURES.index(feature.replace("_units", "_kunits"))]) * scale

    def predict(self, features: StepFeatures) -> float:
        if self.coef is None:
            return 0.0
        return float(features.vector() @ self.coef)

    def coefficients(self) -> dict[str, float]:
        if self.coef is None:
            return {}
        return dict(zip(FEATURES, (float(c) for c in self.coef), strict=True))
