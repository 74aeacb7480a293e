"""The gate: which detected frames are worth a (costly) VLM description.

Why: a camera sampled at 2 fps with someone standing in view would otherwise ask the VLM
for 7,200 near-identical descriptions an hour. Per camera, a frame passes when it shows at
least ``min_persons`` people and either the cooldown since the last sent frame has passed
or the number of people changed (someone arrived or left) -- the change is news, so it
skips the cooldown, but never faster than ``min_interval_s``. Every verdict has a reason
and is counted, so "why was nothing described?" has an answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines import metrics
from pipelines.config import GateConfig


@dataclass(frozen=True)
class Verdict:
    send: bool
    reason: str  # first | cooldown_elapsed | count_changed | too_few_persons | cooldown | ...


@dataclass
class _CameraState:
    last_sent: float | None = None
    # persons in the scene as last reported: the count of the last sent frame, or the
    # (too small) count seen since, so that people arriving in an emptied scene are news
    reported: int | None = None


class Gate:
    """Per-camera gate state; ``decide`` is called once per detected frame, in time order."""

    def __init__(self, config: GateConfig) -> None:
        self.config = config
        self._cameras: dict[str, _CameraState] = {}

    def decide(self, camera_id: str, persons: int, now: float) -> Verdict:
        """Verdict for a frame with ``persons`` detections taken at ``now`` (seconds)."""
        verdict = self._decide(self._cameras.setdefault(camera_id, _CameraState()), persons, now)
        metrics.GATE_DECISIONS.labels(
            camera_id, "send" if verdict.send else "skip", verdict.reason
        ).inc()
        return verdict

    def _decide(self, state: _CameraState, persons: int, now: float) -> Verdict:
        cfg = self.config
        if persons < cfg.min_persons:
            state.reported = persons
            return Verdict(False, "too_few_persons")
        changed = state.reported is not None and persons != state.reported
        since = None if state.last_sent is None else now - state.last_sent
        if since is None:
            verdict = Verdict(True, "first")
        elif since < cfg.min_interval_s:
            verdict = Verdict(False, "min_interval")
        elif since >= cfg.cooldown_s:
            verdict = Verdict(True, "cooldown_elapsed")
        elif changed and cfg.send_on_change:
            verdict = Verdict(True, "count_changed")
        else:
            verdict = Verdict(False, "cooldown")
        if verdict.send:
            state.last_sent = now
            state.reported = persons
        return verdict
