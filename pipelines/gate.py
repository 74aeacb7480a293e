"""The gate: which detected frames are worth a (costly) VLM description.

Why: a camera sampled at 2 fps with someone standing in view would otherwise ask the VLM
for 7,200 near-identical descriptions an hour. Per camera, a frame passes when it shows at
least ``min_persons`` people and either the cooldown since the last sent frame has passed
or the number of people changed (someone arrived or left) -- the change is news, so it
skips the cooldown, but never faster than ``min_interval_s``. Every verdict has a reason
and is counted, so "why was nothing described?" has an answer.

With ``describe_on`` naming track events, a camera is gated per tracked object instead
(``TrackGate``): someone standing in view for an hour is one description (``track_start``,
once the track is *qualified*), optionally a last one when they leave (``track_end``, after
``lost_frames`` frames unseen, with the last frame they were seen in) and one every
``interval_s`` while they stay in (``interval``) -- never more than ``max_descriptions``.

Qualified = significant and placed. Significant: the track was seen in ``min_frames`` frames
(anywhere: is this a real object the tracker follows, or a flicker?). Placed, when the camera
has ``required_zones``: the track is in one of them by that zone's ``inertia`` and
``loitering_time`` (``pipelines.presence``: is it really there, and staying?). The two count
from the track's first frame side by side, so with both at 3 a person who walks into the
zone is described on their third frame there, and one who walked elsewhere first on their
third frame inside; ``min_frames`` alone gates a camera without required zones. A track that
never qualified is never described, not even when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines import metrics
from pipelines.config import GateConfig
from pipelines.detect import Detection
from pipelines.ingest import Frame
from pipelines.presence import Place, TrackZones
from pipelines.zones import CameraZones


@dataclass(frozen=True)
class Verdict:
    send: bool
    reason: str  # first | cooldown_elapsed | count_changed | too_few_persons | cooldown | ...
    tracks: tuple[int, ...] = ()  # per-track gating: the tracks the description is for


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


@dataclass(frozen=True)
class Trigger:
    """A description to send: the frame, its detections, and why (``verdict.tracks``: the
    tracks it is for; ``suffix`` tells apart two sends of one frame, e.g. ``end``)."""

    frame: Frame
    detections: list[Detection]
    verdict: Verdict
    suffix: str = ""


@dataclass
class _Track:
    last_index: int  # the camera's frame number when last seen
    zones: TrackZones  # where it is, by the zones' inertia and loitering_time
    frame: Frame | None = None  # the last frame it was seen in (for track_end)
    detection: Detection | None = None
    seen: int = 0  # frames it was seen in
    qualified_at: float | None = None  # first seen significant and in a required zone
    started: bool = False  # track_start sent
    described: int = 0
    last_described: float | None = None
    ended: bool = False


class TrackGate:
    """One camera's per-track gate; ``decide`` is called once per detected frame, in time
    order, with the frame's detections after tracking (``track_id`` set where tracked)."""

    def __init__(self, camera_id: str, config: GateConfig, zones: CameraZones) -> None:
        self.camera_id = camera_id
        self.config = config
        self.zones = zones
        self.events = set(config.describe_on)
        self.tracks: dict[int, _Track] = {}
        self.index = 0
        self.last_sent: float | None = None

    def decide(self, frame: Frame, detections: list[Detection]) -> list[Trigger]:
        """What to send for this frame: at most one description of it (for every track that
        is due) plus one per group of tracks that ended (on the frame they were last seen)."""
        self.index += 1
        now = frame.ts
        size = (frame.image.shape[1], frame.image.shape[0])
        due, skip = self._update_tracks(frame, detections, size, now)
        out = self._ended()
        if due and self.last_sent is not None and now - self.last_sent < self.config.min_interval_s:
            due, skip = [], "min_interval"  # still due on a later frame
        if due:
            reason = "track_start" if any(not t.started for _, t in due) else "track_interval"
            for _, track in due:
                track.started = True
                track.described += 1
                track.last_described = now
            self.last_sent = now
            verdict = Verdict(True, reason, tuple(tid for tid, _ in due))
            out.insert(0, Trigger(frame, detections, verdict))
        else:
            self._count(Verdict(False, skip))
        for trigger in out:
            self._count(trigger.verdict)
        return out

    def _update_tracks(
        self, frame: Frame, detections: list[Detection], size: tuple[int, int], now: float
    ) -> tuple[list[tuple[int, _Track]], str]:
        """Record this frame's tracks; return those due for a description and, for when none
        is, the reason to skip the frame."""
        cfg = self.config
        due: list[tuple[int, _Track]] = []
        reasons: set[str] = set()
        for det in detections:
            if det.track_id is None:
                reasons.add("track_unconfirmed")
                continue
            track = self.tracks.get(det.track_id)
            if track is None:
                zones = TrackZones(self.zones.zones)
                track = self.tracks[det.track_id] = _Track(self.index, zones)
            track.last_index, track.frame, track.detection = self.index, frame, det
            track.ended = False
            track.seen += 1
            place = self._place(track, det, size, now)
            if track.seen < cfg.min_frames:
                reasons.add("not_significant")
                continue
            if place != "in":
                reasons.add(PLACE_REASONS[place])  # not there (yet), or not any more
                continue
            if track.qualified_at is None:
                track.qualified_at = now
            if track.described >= cfg.max_descriptions:
                reasons.add("max_descriptions")
            elif self._due(track, now):
                due.append((det.track_id, track))
            else:
                reasons.add("already_described")
        return due, _first(reasons, "no_tracks")

    def _place(self, track: _Track, det: Detection, size: tuple[int, int], now: float) -> Place:
        """Where the track is this frame as far as the gate cares: in a required zone (by
        its inertia and loitering_time), on its way in, or outside; "in" without any."""
        track.zones.update(self.zones.zones_of(det, size), now)
        if not self.zones.required:
            return "in"
        return track.zones.place_among(self.zones.required)

    def _due(self, track: _Track, now: float) -> bool:
        if "track_start" in self.events and not track.started:
            return True
        return "interval" in self.events and self._interval_due(track, now)

    def _interval_due(self, track: _Track, now: float) -> bool:
        since = track.last_described if track.last_described is not None else track.qualified_at
        # without track_start, the first interval description comes interval_s after the
        # track qualified
        return since is not None and now - since >= self.config.interval_s

    def _ended(self) -> list[Trigger]:
        """Tracks unseen for ``lost_frames`` frames have ended: a ``track_end`` description
        of each one that qualified (grouped by the frame they were last seen in); tracks long
        gone are forgotten."""
        cfg = self.config
        groups: dict[int, list[tuple[int, _Track]]] = {}
        for tid, track in list(self.tracks.items()):
            unseen = self.index - track.last_index
            if not track.ended and unseen >= cfg.lost_frames:
                track.ended = True
                if (
                    "track_end" in self.events
                    and track.qualified_at is not None
                    and track.described < cfg.max_descriptions
                    and track.frame is not None
                ):
                    groups.setdefault(id(track.frame), []).append((tid, track))
                else:
                    track.frame = None  # nothing more to send of it: free the image
            elif track.ended and unseen >= cfg.lost_frames + FORGET_AFTER_FRAMES:
                del self.tracks[tid]
        out = []
        for members in groups.values():
            frame = members[0][1].frame
            assert frame is not None
            dets = [t.detection for _, t in members if t.detection is not None]
            for _, track in members:
                track.described += 1
                track.last_described = frame.ts
                track.frame = None
            verdict = Verdict(True, "track_end", tuple(tid for tid, _ in members))
            out.append(Trigger(frame, dets, verdict, suffix="end"))
        return out

    def _count(self, verdict: Verdict) -> None:
        metrics.GATE_DECISIONS.labels(
            self.camera_id, "send" if verdict.send else "skip", verdict.reason
        ).inc()


# an ended track's state is kept this many frames more, in case the tracker finds it again
# (it keeps lost tracks for its own track_buffer): it then goes on, not described anew
FORGET_AFTER_FRAMES = 300

# why a significant track is not described this frame, by its place (``presence.Place``)
PLACE_REASONS: dict[Place, str] = {
    "loitering": "loitering",  # in a required zone, its loitering_time not yet spent
    "inertia": "zone_inertia",  # feet inside, fewer than the zone's inertia frames so far
    "outside": "outside_zones",
}

# when a frame has several reasons to be skipped, the one reported (most telling first)
SKIP_ORDER = (
    "loitering",
    "zone_inertia",
    "outside_zones",
    "not_significant",
    "already_described",
    "max_descriptions",
    "track_unconfirmed",
)


def _first(reasons: set[str], default: str) -> str:
    return next((r for r in SKIP_ORDER if r in reasons), default)
