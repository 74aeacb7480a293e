"""Where detections count: masks, per-class filters, zones, and the region the VLM sees.

Why here, before the gate: a box on a poster, a reflection, or a person on the pavement
outside the garden should never wake the VLM, and "why was nothing described?" needs an
answer -- every dropped detection is counted with its reason. Names and rules follow
Frigate: a detection is *in* a polygon when the bottom centre of its box (where a person
stands) is inside it (``cv2.pointPolygonTest``); ``min_area``/``max_area`` are pixels when
>= 1, else a share of the frame; ratios are width / height.

Polygons are configured relative (0-1) or in pixels; they are resolved to pixel contours
once per frame size, since a camera's resolution is only known from its frames.

This module answers for one frame. Whether a *tracked* person is in a zone -- the zone's
``inertia`` and ``loitering_time``, judged over the track's frames -- is
``pipelines.presence``, which the per-track gate feeds with ``zones_of``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import cv2
import numpy as np

from pipelines import metrics
from pipelines.config import CameraConfig, FilterConfig, Point
from pipelines.detect import Detection

Box = tuple[float, float, float, float]


def contour(points: Sequence[Point], size: tuple[int, int]) -> np.ndarray:
    """Pixel contour (``float32``, N x 1 x 2) of a polygon in a ``size`` = (w, h) frame."""
    w, h = size
    relative = all(x <= 1.0 and y <= 1.0 for x, y in points)
    sx, sy = (w, h) if relative else (1.0, 1.0)
    return np.array([[[x * sx, y * sy]] for x, y in points], np.float32)


def bottom_centre(box: Box) -> tuple[float, float]:
    return ((box[0] + box[2]) / 2.0, box[3])


def inside(polygon: np.ndarray, point: tuple[float, float]) -> bool:
    """On the edge counts as inside."""
    return cv2.pointPolygonTest(polygon, (float(point[0]), float(point[1])), False) >= 0


class CameraZones:
    """One camera's masks, filters and zones, applied to its detections."""

    def __init__(self, camera: CameraConfig) -> None:
        self.camera_id = camera.id
        self.zones = camera.zones
        self.required = list(camera.required_zones)
        self.objects = camera.objects

    @property
    def active(self) -> bool:
        """Anything to check at all (else detections pass untouched)."""
        return bool(self.objects.mask or self.objects.filters or self.required)

    @functools.lru_cache(maxsize=8)  # noqa: B019  (one instance per camera, few frame sizes)
    def _contours(self, size: tuple[int, int]) -> dict[str, list[np.ndarray]]:
        out = {"__mask__": [contour(p, size) for p in self.objects.mask]}
        for label, flt in self.objects.filters.items():
            out[f"__mask__:{label}"] = [contour(p, size) for p in flt.mask]
        for name, zone in self.zones.items():
            out[name] = [contour(zone.coordinates, size)]
        return out

    def filter(self, detections: list[Detection], size: tuple[int, int]) -> list[Detection]:
        """Detections that pass the masks and the per-class filters; each drop is counted
        (``vs_detections_filtered{reason}``: ``mask``, ``min_area``, ``max_ratio``...)."""
        if not (self.objects.mask or self.objects.filters):
            return detections
        contours = self._contours(size)
        kept = []
        for det in detections:
            reason = self._drop_reason(det, size, contours)
            if reason is None:
                kept.append(det)
            else:
                metrics.DETECTIONS_FILTERED.labels(self.camera_id, reason).inc()
        return kept

    def _drop_reason(
        self, det: Detection, size: tuple[int, int], contours: dict[str, list[np.ndarray]]
    ) -> str | None:
        foot = bottom_centre(det.box)
        if any(inside(c, foot) for c in contours["__mask__"]):
            return "mask"
        flt = self.objects.filters.get(det.label)
        if flt is None:
            return None
        if any(inside(c, foot) for c in contours[f"__mask__:{det.label}"]):
            return "mask"
        return filter_reason(flt, det, size)

    def zones_of(self, det: Detection, size: tuple[int, int]) -> list[str]:
        """Names of the zones the detection is in (bottom centre inside, label allowed)."""
        contours = self._contours(size)
        foot = bottom_centre(det.box)
        return [
            name
            for name, zone in self.zones.items()
            if (not zone.objects or det.label in zone.objects) and inside(contours[name][0], foot)
        ]

    def in_required(self, det: Detection, size: tuple[int, int]) -> bool:
        """In one of ``required_zones`` on this frame alone; true for every detection when
        none are required. The per-frame gate's test: it has no track ids, so no inertia."""
        if not self.required:
            return True
        return any(name in self.required for name in self.zones_of(det, size))

    def zone_rect(self, size: tuple[int, int]) -> Box:
        """Bounding rectangle of the required zones (else of all zones), clipped to the frame."""
        names = self.required or list(self.zones)
        contours = self._contours(size)
        points = np.concatenate([contours[n][0].reshape(-1, 2) for n in names])
        x1, y1 = points.min(axis=0)
        x2, y2 = points.max(axis=0)
        w, h = size
        return (max(0.0, float(x1)), max(0.0, float(y1)), min(w, float(x2)), min(h, float(y2)))


def filter_reason(flt: FilterConfig, det: Detection, size: tuple[int, int]) -> str | None:
    """Why ``flt`` drops ``det`` (the first failed bound), or None when it passes."""
    x1, y1, x2, y2 = det.box
    bw, bh = max(x2 - x1, 0.0), max(y2 - y1, 0.0)
    area = bw * bh
    frame_area = float(size[0] * size[1])

    def pixels(bound: float) -> float:
        return bound if bound >= 1 else bound * frame_area

    if det.conf < flt.min_score:
        return "min_score"
    if area < pixels(flt.min_area):
        return "min_area"
    if area > pixels(flt.max_area):
        return "max_area"
    ratio = bw / bh if bh > 0 else float("inf")
    if ratio < flt.min_ratio:
        return "min_ratio"
    if ratio > flt.max_ratio:
        return "max_ratio"
    return None


def union(boxes: Iterable[Box]) -> Box | None:
    boxes = list(boxes)
    if not boxes:
        return None
    return (
        min(b[0] for b in boxes),
        min(b[1] for b in boxes),
        max(b[2] for b in boxes),
        max(b[3] for b in boxes),
    )


def padded_crop(
    box: Box, size: tuple[int, int], padding: float, min_side: int
) -> tuple[int, int, int, int]:
    """``box`` grown by ``padding`` x its size on each side and to at least ``min_side``
    pixels (context around a person helps the VLM), kept inside the frame."""
    w, h = size
    x1, y1, x2, y2 = box
    bw, bh = x2 - x1, y2 - y1
    x1, x2 = x1 - bw * padding, x2 + bw * padding
    y1, y2 = y1 - bh * padding, y2 + bh * padding
    x1, x2 = _at_least(x1, x2, min(min_side, w))
    y1, y2 = _at_least(y1, y2, min(min_side, h))
    x1, x2 = _shift_inside(x1, x2, w)
    y1, y2 = _shift_inside(y1, y2, h)
    return (round(x1), round(y1), round(x2), round(y2))


def _at_least(lo: float, hi: float, side: float) -> tuple[float, float]:
    missing = side - (hi - lo)
    return (lo - missing / 2, hi + missing / 2) if missing > 0 else (lo, hi)


def _shift_inside(lo: float, hi: float, limit: float) -> tuple[float, float]:
    if lo < 0:
        lo, hi = 0.0, hi - lo
    if hi > limit:
        lo, hi = max(0.0, lo - (hi - limit)), float(limit)
    return lo, hi
