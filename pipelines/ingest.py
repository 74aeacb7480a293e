"""Camera readers: one thread per camera, newest frame only, reconnect with backoff.

Why a thread that reads continuously: an RTSP client that stops reading builds up a
backlog (in the socket and in FFmpeg), and the frames it later hands out are seconds old.
So each reader drains the stream at the camera's own rate with ``grab()`` (demux + decode,
no colour conversion) and converts only the frames the sampler wants (``retrieve()``) at the
configured ``fps``. The sample goes into a one-frame slot; if the detector has not taken
the previous sample by then, that one is dropped and counted (``detector_busy``) -- the
same choice as Frigate and ultralytics' ``stream_buffer=False``: fresh beats complete.

A stream that fails to open, errors, or stalls past the read timeout is released and
reopened with exponential backoff; files are played at their own frame rate (a simulated
live camera) and restarted at the end.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import cv2
import numpy as np

from pipelines import metrics
from pipelines.backoff import Backoff
from pipelines.config import CameraConfig, IngestConfig
from pipelines.logs import kv

log = logging.getLogger(__name__)

_FFMPEG_OPTIONS_LOCK = threading.Lock()


@dataclass
class Frame:
    """A sampled frame. ``ts`` is wall-clock capture time (other processes compare it)."""

    camera_id: str
    seq: int
    ts: float
    image: np.ndarray


@dataclass
class CameraStats:
    """Plain counters mirrored to Prometheus; tests and the benchmark read these."""

    connected: bool = False
    decoded: int = 0
    sampled: int = 0
    reconnects: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    last_error: str = ""
    decoded_fps: float = 0.0
    last_frame_ts: float = 0.0  # wall time of the newest sampled frame


class LatestFrameSlot:
    """Holds at most one frame; a frame replaced before it was taken is counted as dropped."""

    def __init__(self, on_drop: Callable[[str], None]) -> None:
        self._lock = threading.Lock()
        self._frame: Frame | None = None
        self._on_drop = on_drop

    def put(self, frame: Frame) -> None:
        with self._lock:
            replaced = self._frame
            self._frame = frame
        if replaced is not None:
            self._on_drop("detector_busy")

    def take(self) -> Frame | None:
        with self._lock:
            frame, self._frame = self._frame, None
        return frame


def _open_capture(camera: CameraConfig, ingest: IngestConfig) -> cv2.VideoCapture:
    """Open a source with OpenCV's FFmpeg backend (RTSP over TCP, bounded open/read)."""
    if isinstance(camera.url, int):  # a local device: V4L2 etc., FFmpeg does not apply
        return cv2.VideoCapture(camera.url)
    url = camera.url[len("file://") :] if camera.url.startswith("file://") else camera.url
    params = [
        cv2.CAP_PROP_OPEN_TIMEOUT_MSEC,
        int(ingest.open_timeout_s * 1000),
        cv2.CAP_PROP_READ_TIMEOUT_MSEC,
        int(ingest.read_timeout_s * 1000),
    ]
    # OpenCV reads its FFmpeg options from the environment at open time: set them under a
    # lock so cameras opening concurrently all see the same value.
    with _FFMPEG_OPTIONS_LOCK:
        os.environ["OPENCV_FFMPEG_CAPTURE_OPTIONS"] = ingest.ffmpeg_options
        return cv2.VideoCapture(url, cv2.CAP_FFMPEG, params)


class CameraReader:
    """Reads one camera on a daemon thread and offers its newest sampled frame."""

    def __init__(
        self,
        camera: CameraConfig,
        ingest: IngestConfig,
        on_frame: Callable[[], None] | None = None,
    ) -> None:
        self.camera = camera
        self.ingest = ingest
        self.stats = CameraStats()
        self.slot = LatestFrameSlot(self.count_drop)
        self._on_frame = on_frame  # wakes the detector loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"cam-{camera.id}", daemon=True)
        self._seq = 0
        self._next_sample = 0.0  # monotonic time of the next frame to convert
        self._decode_times: deque[float] = deque(maxlen=64)
        for name in ("detector_busy",):
            metrics.FRAMES_DROPPED.labels(camera.id, name)  # export zeros from the start
        metrics.CAMERA_UP.labels(camera.id).set(0)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to finish; it exits within one read timeout at most."""
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def count_drop(self, reason: str) -> None:
        """Count a sampled frame of this camera that will never be described."""
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        metrics.FRAMES_DROPPED.labels(self.camera.id, reason).inc()

    # -- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        backoff = Backoff(self.ingest.backoff_initial_s, self.ingest.backoff_max_s)
        first = True
        while not self._stop.is_set():
            if not first and backoff.wait(self._stop):
                break
            first = False
            cap = _open_capture(self.camera, self.ingest)
            try:
                if not cap.isOpened():
                    self._lost("open_failed", "cannot open source", backoff.attempts)
                    continue
                log.info(kv("camera_opened", camera=self.camera.id, source=self._source()))
                reason = self._read_until_failure(cap, backoff)
            finally:
                cap.release()
            if reason is None:  # stopping
                break
            if reason == "eof":
                first = True  # a file loop restarts at once, not after a backoff
                if not self.camera.loop:
                    log.info(kv("camera_file_ended", camera=self.camera.id))
                    break
            self._lost(reason, self.stats.last_error or reason, backoff.attempts)
        self._set_connected(False)

    def _read_until_failure(self, cap: cv2.VideoCapture, backoff: Backoff) -> str | None:
        """Read frames until the stream fails; returns the reason, or None when stopping."""
        period = 1.0 / self.camera.fps
        pace = self.camera.is_file and self.camera.realtime
        native_fps = cap.get(cv2.CAP_PROP_FPS) if pace else 0.0
        native_fps = native_fps if 0.0 < native_fps <= 240.0 else 25.0
        started, n_read = time.monotonic(), 0
        while not self._stop.is_set():
            if pace:  # a file plays like a live camera: one frame per 1/native_fps
                delay = started + n_read / native_fps - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    return None
            if not cap.grab():
                if self.camera.is_file and n_read > 0:
                    self.stats.last_error = "end of file"
                    return "eof"
                self.stats.last_error = "read failed or timed out"
                return "read_failed"
            n_read += 1
            now = time.monotonic()
            self._count_decoded(now)
            if n_read == 1:
                backoff.reset()
                self._set_connected(True)
            if now < self._next_sample:
                continue
            ok, image = cap.retrieve()
            if not ok or image is None:
                continue
            # keeps the rate across reconnects and file loops; no burst to catch up
            self._next_sample = max(self._next_sample + period, now)
            self._seq += 1
            self.stats.sampled += 1
            metrics.CAMERA_SAMPLED.labels(self.camera.id).inc()
            wall = time.time()
            self.stats.last_frame_ts = wall
            metrics.CAMERA_LAST_FRAME.labels(self.camera.id).set(wall)
            self.slot.put(Frame(self.camera.id, self._seq, wall, image))
            if self._on_frame is not None:
                self._on_frame()
        return None

    def _count_decoded(self, now: float) -> None:
        self.stats.decoded += 1
        metrics.CAMERA_DECODED.labels(self.camera.id).inc()
        self._decode_times.append(now)
        if len(self._decode_times) >= 2:
            span = self._decode_times[-1] - self._decode_times[0]
            if span > 0:
                self.stats.decoded_fps = (len(self._decode_times) - 1) / span
                metrics.CAMERA_FPS.labels(self.camera.id).set(self.stats.decoded_fps)

    def _lost(self, reason: str, detail: str, attempt: int) -> None:
        self._set_connected(False)
        self.stats.reconnects += 1
        metrics.CAMERA_RECONNECTS.labels(self.camera.id, reason).inc()
        level = logging.INFO if reason == "eof" else logging.WARNING
        log.log(
            level,
            kv(
                "camera_reconnect",
                camera=self.camera.id,
                reason=reason,
                detail=detail,
                attempt=attempt + 1,
            ),
        )

    def _set_connected(self, up: bool) -> None:
        if self.stats.connected != up:
            self.stats.connected = up
            metrics.CAMERA_UP.labels(self.camera.id).set(1 if up else 0)
            if not up:
                self._decode_times.clear()
                self.stats.decoded_fps = 0.0
                metrics.CAMERA_FPS.labels(self.camera.id).set(0)

    def _source(self) -> str:
        """The URL without credentials, for logs."""
        url = str(self.camera.url)
        if "@" in url and "://" in url:
            scheme, rest = url.split("://", 1)
            url = f"{scheme}://***@{rest.rsplit('@', 1)[1]}"  # a password may contain '@'
        return url
