"""The ingest process: camera readers -> batched detector -> per-camera filters, zones and
tracker -> gate -> Redis producer.

Why this shape: readers run on their own threads (OpenCV blocks), the detector runs on the
calling thread over whatever newest frames the cameras have (one batch across cameras),
and Redis writes happen on the producer's thread. No stage waits on a slower one: a frame
that a stage cannot take in time is replaced by a newer one and counted as dropped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from pipelines import metrics
from pipelines.clips import Clip, ClipBuffer
from pipelines.config import CameraConfig, DetectorOverrides, PipelineConfig
from pipelines.detect import Detection
from pipelines.gate import Gate, TrackGate, Verdict
from pipelines.ingest import CameraReader, Frame
from pipelines.logs import kv
from pipelines.queue import FrameQueue, Outgoing
from pipelines.tracking import CameraTracker
from pipelines.zones import CameraZones, padded_crop, union

log = logging.getLogger(__name__)


class FrameDetector(Protocol):
    """What the pipeline needs from a detector (``Detector`` or a test wrapper of it)."""

    def detect(
        self, frames: Sequence[Frame], overrides: dict[str, DetectorOverrides] | None = None
    ) -> list[list[Detection]]: ...


class CameraPipeline:
    """Runs every configured camera until ``stop()``; ``run()`` blocks on the detector loop."""

    def __init__(self, config: PipelineConfig, detector: FrameDetector) -> None:
        self.config = config
        self.detector = detector
        self.gate = Gate(config.gate)
        self.cameras: dict[str, CameraConfig] = {cam.id: cam for cam in config.cameras}
        self.zones = {cam.id: CameraZones(cam) for cam in config.cameras}
        self.gates: dict[str, Gate] = {}  # per-frame gating (a camera with overrides: its own)
        self.track_gates: dict[str, TrackGate] = {}
        self.trackers: dict[str, CameraTracker] = {}
        self.clips: dict[str, ClipBuffer] = {}  # cameras with describer.view clip
        for cam in config.cameras:
            gate = config.gate_for(cam.id)
            if cam.describer.view == "clip":
                self.clips[cam.id] = self._clip_buffer(cam)
            if gate.tracks:
                self.trackers[cam.id] = CameraTracker(cam.id, config.tracker)
                self.track_gates[cam.id] = TrackGate(cam.id, gate, self.zones[cam.id])
            else:
                self.gates[cam.id] = self.gate if gate is config.gate else Gate(gate)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.readers = {
            cam.id: CameraReader(cam, config.ingest, on_frame=self._wake.set)
            for cam in config.cameras
        }
        self.queue = FrameQueue(
            config.redis_url, config.queue, on_drop=self._count_drop, live=self.live_numbers
        )
        self.overrides = {cam.id: cam.detector for cam in config.cameras}
        self.detected: Counter[str] = Counter()  # frames through the detector, per camera
        self.sent: Counter[str] = Counter()  # frames the gate passed, per camera
        self.persons: dict[str, int] = {}  # detections in each camera's latest frame
        self.last_detections: dict[str, list[Detection]] = {}  # filtered, tracked
        self.batches = 0
        self.detect_seconds = 0.0
        self._next_camera = 0

    def _clip_buffer(self, camera: CameraConfig) -> ClipBuffer:
        """The camera's ring: its clip window at its fps, and for ``track_end`` the frames
        back to where an ended track was last seen."""
        gate = self.config.gate_for(camera.id)
        extra = gate.lost_frames if "track_end" in gate.describe_on else 0
        capacity = ClipBuffer.window_capacity(camera.clip_seconds, camera.fps, extra)
        q = self.config.queue
        return ClipBuffer(capacity, q.max_image_side, q.jpeg_quality)

    def _count_drop(self, camera_id: str, reason: str) -> None:
        reader = self.readers.get(camera_id)
        if reader is not None:
            reader.count_drop(reason)
        else:
            metrics.FRAMES_DROPPED.labels(camera_id, reason).inc()

    def live_numbers(self) -> dict[str, dict[str, str]]:
        """Each camera's live numbers for its ``camera:<id>`` hash (``queue.CAMERA_FIELDS``);
        called on the producer's thread, so it only reads plain counters."""
        out: dict[str, dict[str, str]] = {}
        for camera_id, reader in self.readers.items():
            stats = reader.stats
            out[camera_id] = {
                "connected": "1" if stats.connected and reader.alive else "0",
                "decoded_fps": f"{stats.decoded_fps:.2f}",
                "decoded": str(stats.decoded),
                "sampled": str(stats.sampled),
                "detected": str(self.detected[camera_id]),
                "gated": str(self.sent[camera_id]),
                "enqueued": str(self.queue.enqueued_by_camera[camera_id]),
                "dropped": json.dumps(dict(stats.dropped), sort_keys=True),
                "reconnects": str(stats.reconnects),
                "last_frame_ts": f"{stats.last_frame_ts:.3f}",
                "persons": str(self.persons.get(camera_id, 0)),
                "last_error": stats.last_error[:200],
            }
        return out

    def stop(self) -> None:
        """Ask ``run()`` to return (safe from a signal handler or another thread)."""
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        """Start readers and the producer, detect until stopped, then shut down in order."""
        self.queue.start()
        for reader in self.readers.values():
            reader.start()
        log.info(
            kv(
                "pipeline_started",
                cameras=",".join(self.readers) or "-",
                instance=self.queue.instance,
                run=self.queue.run_id,
            )
        )
        try:
            while not self._stop.is_set():
                self._wake.wait(0.5)
                self._wake.clear()
                self.step()
        finally:
            self._shutdown()

    def step(self) -> int:
        """Detect on the newest frame of every camera that has one; returns frames handled."""
        frames = self._take_frames()
        if not frames:
            return 0
        started = time.monotonic()
        try:
            detections = self.detector.detect(frames, self.overrides)
        except Exception as exc:  # one bad batch must not stop every camera
            log.exception(kv("detector_failed", frames=len(frames), error=repr(exc)))
            for frame in frames:
                self.readers[frame.camera_id].count_drop("detector_error")
            return 0
        self.detect_seconds += time.monotonic() - started
        self.batches += 1
        for frame, dets in zip(frames, detections, strict=True):
            for item in self.process(frame, dets):
                self.sent[frame.camera_id] += 1
                self.queue.submit(item)
        return len(frames)

    def process(self, frame: Frame, dets: list[Detection]) -> list[Outgoing]:
        """One detected frame through filters, tracker and gate: what to send for it."""
        camera_id = frame.camera_id
        self.detected[camera_id] += 1
        dets = self._follow(frame, dets)
        metrics.CAMERA_PERSONS.labels(camera_id).set(len(dets))
        self.persons[camera_id] = len(dets)
        self.last_detections[camera_id] = dets
        ring = self.clips.get(camera_id)
        if ring is not None:
            ring.add(frame, dets)
        return self._gate(frame, dets)

    def _follow(self, frame: Frame, dets: list[Detection]) -> list[Detection]:
        """The camera's masks and object filters, then its tracker (which must see every
        frame, empty ones too, to know a track was lost)."""
        zones = self.zones.get(frame.camera_id)
        if zones is not None:
            dets = zones.filter(dets, (frame.image.shape[1], frame.image.shape[0]))
        tracker = self.trackers.get(frame.camera_id)
        return dets if tracker is None else tracker.update(dets, frame.image)

    def _gate(self, frame: Frame, dets: list[Detection]) -> list[Outgoing]:
        """What goes to Redis for this frame: per-track triggers, or the per-frame verdict
        counting only detections inside the required zones."""
        camera_id = frame.camera_id
        track_gate = self.track_gates.get(camera_id)
        if track_gate is not None:
            return [
                self._outgoing(t.frame, t.detections, t.verdict, t.suffix)
                for t in track_gate.decide(frame, dets)
            ]
        zones = self.zones.get(camera_id)
        if zones is not None and zones.required:
            size = (frame.image.shape[1], frame.image.shape[0])
            counted = [d for d in dets if zones.in_required(d, size)]
        else:
            counted = dets
        verdict = self.gates.get(camera_id, self.gate).decide(camera_id, len(counted), frame.ts)
        if not verdict.send:
            return []
        return [self._outgoing(frame, dets, verdict, focus=counted)]

    def _outgoing(
        self,
        frame: Frame,
        dets: list[Detection],
        verdict: Verdict,
        suffix: str = "",
        focus: list[Detection] | None = None,
    ) -> Outgoing:
        """The queue item, cropped to what the camera's ``describer.view`` shows the VLM:
        the boxes of the triggering tracks (or ``focus``) padded, or the zones."""
        camera = self.cameras.get(frame.camera_id)
        crop = None
        if camera is not None and camera.describer.view == "clip":
            clip = self._clip(camera, frame, dets, verdict, focus)
            return Outgoing(frame, dets, verdict.reason, verdict.tracks, None, suffix, clip)
        if camera is not None and camera.describer.view != "frame":
            view = camera.describer
            size = (frame.image.shape[1], frame.image.shape[0])
            if view.view == "zone":
                crop = padded_crop(self.zones[camera.id].zone_rect(size), size, 0, view.min_crop)
            else:
                if focus is None:
                    focus = [d for d in dets if d.track_id in verdict.tracks] or dets
                box = union(d.box for d in focus)
                if box is not None:
                    crop = padded_crop(box, size, view.crop_padding, view.min_crop)
        return Outgoing(frame, dets, verdict.reason, verdict.tracks, crop, suffix)

    def _clip(
        self,
        camera: CameraConfig,
        frame: Frame,
        dets: list[Detection],
        verdict: Verdict,
        focus: list[Detection] | None,
    ) -> Clip:
        """The clip for a trigger on ``frame``: the camera's kept frames showing the
        triggering tracks (per-frame gating: all of them) up to ``frame``, cropped to the
        padded union of those tracks' boxes over the clip (per-frame gating: of every box,
        the last frame's ``focus`` ones)."""
        view = camera.describer
        ring = self.clips[camera.id]
        frames = ring.clip(frame, dets, verdict.tracks, view.clip_frames, camera.clip_seconds)
        if not view.clip_crop:
            return Clip(frames)
        wanted = set(verdict.tracks)
        boxes = [
            d.box for f in frames[:-1] for d in f.detections if not wanted or d.track_id in wanted
        ]
        if focus is None:
            focus = [d for d in dets if d.track_id in wanted] or dets
        box = union([*boxes, *(d.box for d in focus)])
        if box is None:
            return Clip(frames)
        size = (frame.image.shape[1], frame.image.shape[0])
        return Clip(frames, padded_crop(box, size, view.crop_padding, view.min_crop))

    def _take_frames(self) -> list[Frame]:
        # round-robin start, so with more cameras than max_batch none is always last
        readers = list(self.readers.values())
        if not readers:
            return []
        start = self._next_camera % len(readers)
        ordered = readers[start:] + readers[:start]
        frames: list[Frame] = []
        for reader in ordered:
            if len(frames) >= self.config.detector.max_batch:
                break
            frame = reader.slot.take()
            if frame is not None:
                frames.append(frame)
        self._next_camera += 1
        return frames

    def _shutdown(self) -> None:
        log.info(kv("pipeline_stopping", buffered=self.queue.pending()))
        for reader in self.readers.values():
            reader.stop(timeout=0.1)
        for reader in self.readers.values():
            reader.stop(timeout=self.config.ingest.read_timeout_s + 1.0)
            if reader.slot.take() is not None:  # sampled but never detected
                reader.count_drop("shutdown_undetected")
        self.queue.stop(flush_timeout=5.0)
        log.info(
            kv("pipeline_stopped", enqueued=self.queue.enqueued, detected=self.detected.total())
        )
