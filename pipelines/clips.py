"""The clip view: a camera's recent frames, kept small, and the clip a trigger sends.

Why a ring of JPEGs: a description of motion ("walked to the door and left") needs the
frames before the one that triggered it, and by then the reader has moved on. A camera with
``describer.view: clip`` therefore keeps its last detected frames, each downscaled to
``queue.max_image_side`` and JPEG-encoded at ``queue.jpeg_quality`` (a few tens to a few
hundred KB each, instead of megabytes of pixels), with its detections after tracking.

Memory bound: per camera at most ``capacity`` JPEGs of at most ``max_image_side`` pixels on
the longer side -- ``capacity`` = the frames the clip's window holds at the camera's ``fps``
(``clip_seconds * fps``, at most ``config.CLIP_MAX_WINDOW_FRAMES``) + 1, plus
``gate.lost_frames`` when the camera describes ``track_end`` (that trigger's frame is the one
the track was last seen in, ``lost_frames`` frames back). E.g. 8 frames at 2 fps, 1280 px,
quality 85: 9 JPEGs of ~150 KB, about 1.4 MB.

A clip is chosen on the detector's thread (cheap: references to JPEG bytes); decoding,
cropping and re-encoding happen on the producer's thread (``queue.encode_clip``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import cv2
import numpy as np

from pipelines.detect import Detection
from pipelines.ingest import Frame


@dataclass(frozen=True)
class ClipFrame:
    """One kept frame: its JPEG (downscaled by ``scale``) and its detections in the
    original frame's pixels."""

    seq: int
    ts: float
    jpeg: bytes
    scale: float  # JPEG pixels per frame pixel (<= 1)
    size: tuple[int, int]  # the original frame's (width, height)
    detections: tuple[Detection, ...]


@dataclass(frozen=True)
class Clip:
    """The frames one description shows, oldest first (the last is the trigger's frame),
    and the region of the frame to crop them to (original pixels; None: the whole frame)."""

    frames: tuple[ClipFrame, ...]
    crop: tuple[int, int, int, int] | None = None

    @property
    def seconds(self) -> float:
        return self.frames[-1].ts - self.frames[0].ts if self.frames else 0.0


def encode_frame(frame: Frame, detections: Iterable[Detection], max_side: int, quality: int):
    """``frame`` as a kept ``ClipFrame``: downscaled to ``max_side``, JPEG at ``quality``."""
    image = frame.image
    height, width = image.shape[:2]
    scale = min(1.0, max_side / max(height, width))
    if scale < 1.0:
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        image = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
    ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError("JPEG encoding failed")
    return ClipFrame(frame.seq, frame.ts, buf.tobytes(), scale, (width, height), tuple(detections))


def pick_evenly(count: int, wanted: int) -> list[int]:
    """``wanted`` indices of ``range(count)`` spread evenly, first and last included (all of
    them when there are no more than ``wanted``)."""
    if count <= wanted:
        return list(range(count))
    return sorted({round(i * (count - 1) / (wanted - 1)) for i in range(wanted)})


class ClipBuffer:
    """One camera's ring of recent frames (see the module docstring for its memory bound)."""

    def __init__(self, capacity: int, max_side: int, quality: int) -> None:
        self.capacity = max(2, capacity)
        self.max_side = max_side
        self.quality = quality
        self._frames: deque[ClipFrame] = deque(maxlen=self.capacity)

    @classmethod
    def window_capacity(cls, seconds: float, fps: float, extra: int = 0) -> int:
        """Frames to keep for clips reaching ``seconds`` back at ``fps``, plus ``extra``."""
        return math.ceil(seconds * fps - 1e-9) + 1 + extra

    def __len__(self) -> int:
        return len(self._frames)

    def add(self, frame: Frame, detections: Iterable[Detection]) -> None:
        """Keep ``frame`` (call once per detected frame, in time order)."""
        self._frames.append(encode_frame(frame, detections, self.max_side, self.quality))

    def clip(
        self,
        end: Frame,
        end_detections: Iterable[Detection],
        tracks: Iterable[int],
        count: int,
        seconds: float,
    ) -> tuple[ClipFrame, ...]:
        """Up to ``count`` kept frames, evenly spread over the ``seconds`` up to ``end``
        (inclusive), of the frames that show one of ``tracks`` (none named: every frame);
        frames of another size than ``end`` (the camera changed resolution) are left out.
        ``end`` itself is always the last: encoded now if it is no longer kept."""
        wanted = set(tracks)
        size = (end.image.shape[1], end.image.shape[0])
        chosen = [
            f
            for f in self._frames
            if end.ts - seconds - 1e-6 <= f.ts <= end.ts
            and f.seq != end.seq
            and f.size == size
            and (not wanted or any(d.track_id in wanted for d in f.detections))
        ]
        last = next((f for f in reversed(self._frames) if f.seq == end.seq), None)
        if last is None:  # evicted (or never added): the trigger frame is still at hand
            last = encode_frame(end, end_detections, self.max_side, self.quality)
        chosen.append(last)
        return tuple(chosen[i] for i in pick_evenly(len(chosen), count))


def decode(frame: ClipFrame) -> np.ndarray:
    image = cv2.imdecode(np.frombuffer(frame.jpeg, np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        raise ValueError("a kept clip frame does not decode")
    return image
