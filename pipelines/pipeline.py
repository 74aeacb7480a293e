"""The ingest process: camera readers -> batched detector -> gate -> Redis producer.

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
from pipelines.config import DetectorOverrides, PipelineConfig
from pipelines.detect import Detection
from pipelines.gate import Gate
from pipelines.ingest import CameraReader, Frame
from pipelines.logs import kv
from pipelines.queue import FrameQueue, Outgoing

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
        self.batches = 0
        self.detect_seconds = 0.0
        self._next_camera = 0

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
            self.detected[frame.camera_id] += 1
            metrics.CAMERA_PERSONS.labels(frame.camera_id).set(len(dets))
            self.persons[frame.camera_id] = len(dets)
            verdict = self.gate.decide(frame.camera_id, len(dets), frame.ts)
            if verdict.send:
                self.sent[frame.camera_id] += 1
                self.queue.submit(Outgoing(frame, dets, verdict.reason))
        return len(frames)

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
