"""Person detection with Ultralytics YOLO26, batched across cameras.

Why batched: on a small CPU the per-call overhead of the detector (pre/post-processing,
thread start-up in torch) is a large share of a 320-640 px inference, so one call over the
newest frame of every camera sustains more frames per second than one call per camera.
Cameras share the model; their overrides (``conf``, ``classes``) are applied to the results,
and cameras with a different ``imgsz`` run as their own sub-batch.

Offline by design: ``YOLO_OFFLINE`` / ``YOLO_AUTOINSTALL`` are set before ultralytics is
imported, and missing ``.pt`` weights are an error, never a download.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipelines import metrics
from pipelines.config import DetectorConfig, DetectorOverrides
from pipelines.ingest import Frame
from pipelines.logs import kv

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_AUTOINSTALL", "False")

log = logging.getLogger(__name__)


class DetectorError(RuntimeError):
    """The detector cannot be built; the message says what to change in the config."""


@dataclass(frozen=True)
class Detection:
    """One box in pixel coordinates of the frame it was found in."""

    cls: int
    label: str
    conf: float
    box: tuple[float, float, float, float]  # x1, y1, x2, y2

    def to_dict(self) -> dict[str, Any]:
        return {
            "cls": self.cls,
            "label": self.label,
            "conf": round(self.conf, 3),
            "box": [round(v, 1) for v in self.box],
        }


def resolve_weights(weights: str) -> str:
    """A model ``.yaml`` (built untrained) or an existing weights file; never a download."""
    if weights.endswith((".yaml", ".yml")):
        return weights
    path = Path(weights).expanduser()
    if path.is_file():
        return str(path)
    try:  # ultralytics' own weights folder, where `yolo` puts files it fetched earlier
        from ultralytics.utils import SETTINGS

        candidate = Path(SETTINGS.get("weights_dir", "")) / path.name
        if candidate.is_file():
            return str(candidate)
    except Exception:  # settings unreadable: just report the file as missing
        pass
    raise DetectorError(
        f"detector.weights: {weights!r} not found, and this pipeline never downloads weights. "
        "Put the weights file at that path (e.g. yolo26n.pt from Ultralytics), or pass a "
        "model .yaml such as 'yolo26n.yaml' to build an untrained model."
    )


def coco_names_if_untrained(names: dict[int, str]) -> dict[int, str]:
    """An untrained 80-class model is named '0'..'79'; give it COCO's names (0 = person)."""
    if len(names) != 80 or any(names[i] != str(i) for i in names):
        return names
    import ultralytics
    import yaml

    coco = Path(ultralytics.__file__).parent / "cfg" / "datasets" / "coco.yaml"
    if not coco.is_file():
        return names
    return {int(k): str(v) for k, v in yaml.safe_load(coco.read_text())["names"].items()}


class Detector:
    """Wraps ``ultralytics.YOLO``: frames in, per-frame lists of class-filtered detections."""

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        weights = resolve_weights(config.weights)
        started = time.monotonic()
        log.info(kv("detector_loading", weights=weights, device=config.device))
        try:
            from ultralytics import YOLO

            self.model = YOLO(weights)
        except Exception as exc:
            raise DetectorError(f"detector.weights: cannot load {weights!r}: {exc}") from exc
        self.names: dict[int, str] = coco_names_if_untrained(dict(self.model.names))
        self.calls = 0  # real model invocations (tests assert the model ran)
        self._predict([np.zeros((64, 64, 3), np.uint8)], config.imgsz, config.conf, None)
        log.info(
            kv(
                "detector_ready",
                weights=weights,
                imgsz=config.imgsz,
                classes=config.classes,
                load_s=time.monotonic() - started,
            )
        )

    def _predict(
        self, images: list[np.ndarray], imgsz: int, conf: float, classes: list[int] | None
    ) -> list[Any]:
        self.calls += 1
        return self.model.predict(
            images,
            imgsz=imgsz,
            conf=conf,
            classes=classes,
            device=self.config.device,
            verbose=False,
        )

    def detect(
        self, frames: Sequence[Frame], overrides: dict[str, DetectorOverrides] | None = None
    ) -> list[list[Detection]]:
        """Detections per frame, in order. One model call per distinct ``imgsz``."""
        if not frames:
            return []
        overrides = overrides or {}
        settings = [self._settings(overrides.get(f.camera_id)) for f in frames]
        out: list[list[Detection]] = [[] for _ in frames]
        started = time.monotonic()
        for imgsz in sorted({s[0] for s in settings}):
            idx = [i for i, s in enumerate(settings) if s[0] == imgsz]
            min_conf = min(settings[i][1] for i in idx)
            wanted = sorted({c for i in idx for c in settings[i][2]})
            results = self._predict([frames[i].image for i in idx], imgsz, min_conf, wanted)
            for i, result in zip(idx, results, strict=True):
                _, conf, classes = settings[i]
                out[i] = [d for d in self._boxes(result) if d.cls in classes and d.conf >= conf]
        elapsed = time.monotonic() - started
        metrics.DETECT_SECONDS.observe(elapsed)
        metrics.DETECT_BATCH.observe(len(frames))
        for frame in frames:
            metrics.DETECT_FRAMES.labels(frame.camera_id).inc()
        return out

    def _settings(self, override: DetectorOverrides | None) -> tuple[int, float, list[int]]:
        cfg = self.config
        if override is None:
            return cfg.imgsz, cfg.conf, cfg.classes
        return (
            override.imgsz or cfg.imgsz,
            cfg.conf if override.conf is None else override.conf,
            cfg.classes if override.classes is None else override.classes,
        )

    def _boxes(self, result: Any) -> list[Detection]:
        boxes = result.boxes
        if boxes is None or len(boxes) == 0:
            return []
        xyxy = boxes.xyxy.cpu().numpy().tolist()
        confs = boxes.conf.cpu().numpy().tolist()
        classes = boxes.cls.cpu().numpy().astype(int).tolist()
        return [
            Detection(c, self.names.get(c, str(c)), float(p), tuple(float(v) for v in b))
            for b, p, c in zip(xyxy, confs, classes, strict=True)
        ]


InjectFn = Callable[[Frame, list[Detection]], list[Detection]]


class InjectedDetections:
    """TEST HOOK: runs the real detector, then lets ``inject`` replace each frame's boxes.

    Why: untrained YOLO weights (all that exists offline) find no people, yet the gate, the
    queue and the describers must be exercised end to end with the real model in the loop.
    Never used by the CLI.
    """

    def __init__(self, detector: Detector, inject: InjectFn) -> None:
        self.detector = detector
        self.inject = inject
        self.names = detector.names

    @property
    def calls(self) -> int:
        return self.detector.calls

    def detect(
        self, frames: Sequence[Frame], overrides: dict[str, DetectorOverrides] | None = None
    ) -> list[list[Detection]]:
        real = self.detector.detect(frames, overrides)
        return [self.inject(frame, dets) for frame, dets in zip(frames, real, strict=True)]
