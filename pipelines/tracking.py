"""Per-camera multi-object tracking with Ultralytics' ByteTrack / BoT-SORT.

Why the tracker classes and not ``model.track(persist=True)``: ``track`` keeps one tracker
state per model (per predictor stream), and our detector is one model batched across every
camera -- the state of camera A would be fed camera B's boxes. So detection stays batched
(``pipelines.detect``) and each camera gets its own tracker object, fed that camera's
detections after the batch. The trackers' settings come from Ultralytics' own
``cfg/trackers/<type>.yaml``, with ``tracker:`` fields from our config replacing its values.
Those defaults suit COCO weights (scores 0.6-0.9); a detector whose scores sit near a low
threshold needs ``fuse_score: false`` and its threshold as ``track_high_thresh`` /
``new_track_thresh`` (``DetectorBuild.tracker_settings``), else a new track's second frame
never matches and no track confirms.

A track id is what lets the gate describe a person once rather than every frame; it is
unique within a camera for the life of the pipeline process.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pipelines import metrics
from pipelines.config import TrackerConfig
from pipelines.detect import Detection


def tracker_args(cfg: TrackerConfig) -> Any:
    """Ultralytics' namespace for ``<type>.yaml`` with our overrides applied."""
    from ultralytics.utils import YAML, IterableSimpleNamespace
    from ultralytics.utils.checks import check_yaml

    args = dict(YAML.load(check_yaml(f"{cfg.type}.yaml")))
    for key, value in cfg.model_dump(exclude={"type"}, exclude_none=True).items():
        if key in args:
            args[key] = value
    args["with_reid"] = False  # a ReID model would be a second network per frame: not here
    return IterableSimpleNamespace(**args)


class CameraTracker:
    """One camera's tracker: detections in, the same detections with ``track_id`` set.

    A detection the tracker has not (yet) confirmed -- ByteTrack activates a new track on its
    second matched frame, except on the very first frame -- keeps ``track_id=None``.
    """

    def __init__(self, camera_id: str, cfg: TrackerConfig) -> None:
        from ultralytics.trackers.bot_sort import BOTSORT
        from ultralytics.trackers.byte_tracker import BYTETracker

        self.camera_id = camera_id
        args = tracker_args(cfg)
        self.tracker = BOTSORT(args) if cfg.type == "botsort" else BYTETracker(args)
        self.last_id = 0  # ids rise from 1: a higher one is a new track

    def update(self, detections: list[Detection], image: np.ndarray) -> list[Detection]:
        """Advance the tracker by one frame (call it for every detected frame, even empty)."""
        from ultralytics.engine.results import Boxes

        data = np.array([[*d.box, d.conf, d.cls] for d in detections], np.float32).reshape(-1, 6)
        rows = self.tracker.update(Boxes(data, image.shape[:2]), image)
        ids: dict[int, int] = {}
        for row in rows:  # x1, y1, x2, y2, track_id, score, cls, idx (detection index)
            ids[int(row[-1])] = int(row[4])
        new = max(ids.values(), default=0) - self.last_id
        if new > 0:
            metrics.TRACKS_STARTED.labels(self.camera_id).inc(new)
            self.last_id += new
        return [dataclasses.replace(d, track_id=ids.get(i)) for i, d in enumerate(detections)]
