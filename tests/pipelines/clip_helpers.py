"""Generated clips with known boxes: people from Ultralytics' sample images walking across
a fixed background, and a detector stand-in that finds them by background difference.

Two kinds of walkers. ``Walker``: a rectangle of ``bus.jpg`` around a person, found by the
``DifferenceDetector`` (pixels that differ from the empty background), so the unit tests of
tracking, gating and zones see exactly what moves and need no trained model. ``Cutout``: one
of the people ``vision-serve make-detector`` trains on (``synthetic.person_sprites()``,
GrabCut cut-outs), pasted the way its training frames are, for the tests that run the
trained detector on a clip.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import cv2
import numpy as np

from pipelines.config import DetectorOverrides
from pipelines.detect import Detection
from pipelines.ingest import Frame

SIZE = (640, 480)
# persons in bus.jpg resized to 640x480 (x1, y1, x2, y2): a whole one, and a second one
BUS_PERSONS = ((174, 180, 273, 382), (40, 178, 194, 402))

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class Walker:
    """A cut-out walking in a straight line from ``start`` to ``end`` (top-left corners),
    visible from frame ``first`` to frame ``last`` inclusive, at ``scale``."""

    person: int
    start: tuple[float, float]
    end: tuple[float, float]
    first: int
    last: int
    scale: float = 1.0

    def box(self, i: int) -> Box | None:
        if not self.first <= i <= self.last:
            return None
        t = (i - self.first) / max(self.last - self.first, 1)
        x = self.start[0] + (self.end[0] - self.start[0]) * t
        y = self.start[1] + (self.end[1] - self.start[1]) * t
        w, h = sprite(self.person).shape[1] * self.scale, sprite(self.person).shape[0] * self.scale
        return (round(x), round(y), round(x) + round(w), round(y) + round(h))


@functools.cache
def sprite(person: int) -> np.ndarray:
    from ultralytics.utils import ASSETS

    bus = cv2.resize(cv2.imread(str(ASSETS / "bus.jpg")), SIZE)
    x1, y1, x2, y2 = BUS_PERSONS[person]
    return bus[y1:y2, x1:x2].copy()


@functools.cache
def background() -> np.ndarray:
    """A flat two-tone scene (sky and ground): nothing in it differs from itself."""
    image = np.empty((SIZE[1], SIZE[0], 3), np.uint8)
    image[: SIZE[1] // 2] = (200, 170, 140)
    image[SIZE[1] // 2 :] = (90, 110, 90)
    return image


def render(walkers: Sequence[Walker], i: int) -> tuple[np.ndarray, list[Box]]:
    """Frame ``i`` and the boxes of the walkers in it."""
    image = background().copy()
    boxes = []
    for walker in walkers:
        box = walker.box(i)
        if box is None:
            continue
        x1, y1, x2, y2 = (int(v) for v in box)
        image[y1:y2, x1:x2] = cv2.resize(sprite(walker.person), (x2 - x1, y2 - y1))
        boxes.append(box)
    return image, boxes


def frames(walkers: Sequence[Walker], count: int, camera: str = "cam", fps: float = 2.0):
    """The clip as pipeline frames, ``1 / fps`` seconds apart."""
    for i in range(count):
        image, _ = render(walkers, i)
        yield Frame(camera, i + 1, 1000.0 + i / fps, image)


def boxes_by_difference(image: np.ndarray) -> list[Box]:
    """Boxes of the regions that differ from the background (the pasted people)."""
    diff = cv2.absdiff(image, background()).max(axis=2)
    mask = (diff > 12).astype(np.uint8)
    mask = cv2.morphologyEx(mask, cv2.MORPH_CLOSE, np.ones((9, 9), np.uint8))
    count, _, stats, _ = cv2.connectedComponentsWithStats(mask)
    out = []
    for i in range(1, count):
        x, y, w, h, area = stats[i]
        if area >= 400:
            out.append((float(x), float(y), float(x + w), float(y + h)))
    return out


@dataclass(frozen=True)
class Cutout:
    """One of make-detector's cut-out people (``synthetic.person_sprites()[person]``),
    ``height`` pixels tall, feet on the line ``feet_y``, walking with its left edge from
    ``start_x`` to ``end_x``; visible from frame ``first`` to ``last`` inclusive."""

    person: int
    height: int
    feet_y: int
    start_x: float
    end_x: float
    first: int
    last: int

    def box(self, i: int) -> Box | None:
        if not self.first <= i <= self.last:
            return None
        from pipelines import synthetic

        image = synthetic.person_sprites()[self.person].image
        width = self.height * image.shape[1] / image.shape[0]
        t = (i - self.first) / max(self.last - self.first, 1)
        x = self.start_x + (self.end_x - self.start_x) * t
        return (x, float(self.feet_y - self.height), x + width, float(self.feet_y))


def render_cutouts(cutouts: Sequence[Cutout], i: int) -> tuple[np.ndarray, list[Box | None]]:
    """Frame ``i`` on the two-tone ``background()`` and each cut-out's box (None: not in it)."""
    from pipelines import synthetic

    image = background().copy()
    boxes = []
    for cutout in cutouts:
        box = cutout.box(i)
        if box is not None:
            synthetic.paste(image, synthetic.person_sprites()[cutout.person], box)
        boxes.append(box)
    return image, boxes


def write_cutout_clip(path: Path, cutouts: Sequence[Cutout], count: int, fps: int) -> Path:
    """The cut-out clip as an MP4 file (a file camera plays it)."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, SIZE)
    for i in range(count):
        writer.write(render_cutouts(cutouts, i)[0])
    writer.release()
    return path


def iou(a: Box, b: Box) -> float:
    x1, y1, x2, y2 = max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


class DifferenceDetector:
    """A ``FrameDetector`` stand-in: a person wherever the frame differs from the clip's
    background, confidence 0.9. Counts its calls like ``Detector``."""

    names: ClassVar[dict[int, str]] = {0: "person"}

    def __init__(self) -> None:
        self.calls = 0

    def detect(
        self, frames: Sequence[Frame], overrides: dict[str, DetectorOverrides] | None = None
    ) -> list[list[Detection]]:
        self.calls += 1
        return [
            [Detection(0, "person", 0.9, box) for box in boxes_by_difference(f.image)]
            for f in frames
        ]


def write_clip(path: Path, walkers: Sequence[Walker], count: int, fps: int) -> Path:
    """The clip as an MP4 file (a file camera plays it)."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, SIZE)
    for i in range(count):
        writer.write(render(walkers, i)[0])
    writer.release()
    return path
