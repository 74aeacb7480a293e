"""Person detection with Ultralytics YOLO26, batched across cameras.

Why batched: on a small CPU the per-call overhead of the detector (pre/post-processing,
thread start-up in torch) is a large share of a 320-640 px inference, so one call over the
newest frame of every camera sustains more frames per second than one call per camera.
Cameras share the model; their overrides (``conf``, ``classes``) are applied to the results,
and cameras with a different ``imgsz`` run as their own sub-batch.

Offline by design: ``YOLO_OFFLINE`` / ``YOLO_AUTOINSTALL`` are set before ultralytics is
imported, and missing ``.pt`` weights are an error naming the file and where to put it. A
download happens only when asked for (``detector.download: true``, or ``YOLO_OFFLINE=0`` set
by the operator), and only for a bare Ultralytics asset name such as ``yolo26n.pt``.

Besides ``.pt`` weights and model ``.yaml`` files, exported models load too (``vision-serve
export-detector``): an ``.onnx`` file or an ``*_openvino_model/`` directory.
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
    track_id: int | None = None  # set by the camera's tracker (pipelines.tracking), if any

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cls": self.cls,
            "label": self.label,
            "conf": round(self.conf, 3),
            "box": [round(v, 1) for v in self.box],
        }
        if self.track_id is not None:  # untracked entries keep their old shape
            out["track_id"] = self.track_id
        return out


EXPORTED_SUFFIXES = (".onnx", ".torchscript", ".engine", ".tflite")


def download_allowed(config_download: bool) -> bool:
    """Fetching weights is an explicit opt-in: the config's ``download`` or the operator's
    own ``YOLO_OFFLINE=0`` (this module sets ``1`` only as a default)."""
    return config_download or os.environ.get("YOLO_OFFLINE", "1").lower() in ("0", "false")


def resolve_weights(weights: str, download: bool = False) -> str:
    """A model ``.yaml`` (built untrained), an existing weights file or exported model
    (``.onnx`` file, ``*_openvino_model/`` directory), or -- with ``download`` -- a bare
    Ultralytics asset name fetched into ultralytics' weights folder."""
    if weights.endswith((".yaml", ".yml")):
        return weights
    path = Path(weights).expanduser()
    if path.is_file():
        return str(path)
    if path.is_dir():
        if not any(path.glob("*.xml")):
            raise DetectorError(
                f"detector.weights: {weights!r} is a directory without an OpenVINO model "
                "(*.xml); pass a .pt/.onnx file or an *_openvino_model/ directory"
            )
        return str(path)
    weights_dir = _weights_dir()
    if weights_dir is not None and (weights_dir / path.name).is_file():
        return str(weights_dir / path.name)  # where `yolo` put files it fetched earlier
    if download and path.name == weights and path.suffix == ".pt":
        return _download(weights)
    where = f"{path.resolve()}" + (f" or {weights_dir / path.name}" if weights_dir else "")
    fetch = (
        "or set detector.download: true (or YOLO_OFFLINE=0) on a machine with internet access "
        "to let Ultralytics fetch it, "
        if path.name == weights and path.suffix == ".pt"
        else ""
    )
    raise DetectorError(
        f"detector.weights: {weights!r} not found, and downloads are off. Put the file at "
        f"{where} (e.g. yolo26n.pt from https://github.com/ultralytics/assets/releases), "
        f"{fetch}or use `vision-serve make-detector` (a person detector trained offline), "
        "or a model .yaml such as 'yolo26n.yaml' for an untrained model."
    )


def _weights_dir() -> Path | None:
    try:
        from ultralytics.utils import SETTINGS

        return Path(SETTINGS["weights_dir"])
    except Exception:  # settings unreadable: no second place to look
        return None


def _download(name: str) -> str:
    """Fetch an Ultralytics asset (``yolo26n.pt``); a failure is a ``DetectorError``."""
    from ultralytics.utils.downloads import attempt_download_asset

    previous = os.environ.get("YOLO_OFFLINE")
    os.environ["YOLO_OFFLINE"] = "0"  # the operator opted in: let ultralytics go online
    try:
        log.info(kv("detector_downloading", weights=name))
        path = Path(attempt_download_asset(name))
    except Exception as exc:
        raise DetectorError(f"detector.weights: downloading {name!r} failed: {exc}") from exc
    finally:
        if previous is None:
            os.environ.pop("YOLO_OFFLINE", None)
        else:
            os.environ["YOLO_OFFLINE"] = previous
    if not path.is_file():
        raise DetectorError(f"detector.weights: downloading {name!r} produced no file")
    return str(path)


def is_exported(weights: str) -> bool:
    """An exported model (not ``.pt``/``.yaml``): fixed input size, task given at load."""
    return weights.endswith(EXPORTED_SUFFIXES) or Path(weights).is_dir()


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
        weights = resolve_weights(config.weights, download_allowed(config.download))
        started = time.monotonic()
        log.info(kv("detector_loading", weights=weights, device=config.device))
        try:
            from ultralytics import YOLO

            if is_exported(weights):
                self.model = YOLO(weights, task="detect")
            else:
                self.model = YOLO(weights)
        except Exception as exc:
            raise DetectorError(f"detector.weights: cannot load {weights!r}: {exc}") from exc
        if is_exported(weights):
            _check_export_imgsz(weights, config.imgsz)
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
            iou=self.config.iou,  # NMS models (YOLO11 and older) only; validated to (0, 1]
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
                kept = [d for d in self._boxes(result) if d.cls in classes and d.conf >= conf]
                out[i] = drop_duplicates(kept, self.config.iou, self.config.nested)
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


# a nested box is a part of the box around it only when that one scores at least this many
# times higher: a second person inside another's box (a child in front of an adult) scores
# about as high as the first and stays
NESTED_SCORE_RATIO = 2.0
# a nested box covering at least this share of the box around it (their IoU, since one is
# inside the other) is the same object whichever scores higher: the lower goes
NESTED_SAME_OBJECT_IOU = 0.5


def drop_duplicates(
    dets: list[Detection], iou: float, nested: float | None = None
) -> list[Detection]:
    """Class-wise non-maximum suppression at ``iou``, best score first; then, with
    ``nested``, every box with at least that share of its area inside a box of its class
    that scores :data:`NESTED_SCORE_RATIO` times higher, and the lower-scored of a nested
    pair at IoU :data:`NESTED_SAME_OBJECT_IOU` or more (the inner box covers half the outer).

    Why here: YOLO26's end-to-end head is trained to give one box per object, so Ultralytics
    runs no NMS on it (``iou`` is ignored there), but a model at a low threshold still gives
    a second box over the same person now and then (the synthetic detector of
    ``make-detector``: a nested box at IoU 0.69 on ~1 frame in 5). The tracker then starts a
    track on it and, where the two swap scores, hands the person's id to the duplicate: one
    walk, two tracks, two descriptions. A head-and-torso box inside the person's (IoU 0.4,
    wholly inside, a quarter of the person's score: the detector trained on a Zen 5) passes
    NMS, and as its own track it was described as a second person. The detector trained on a
    Zen 3 EPYC gave a torso-and-legs box wholly inside the walker's at IoU 0.53-0.60 (under
    the NMS IoU) on 9 frames in 40, scoring 1.2-2.1x above or below it: the two tracks took
    turns as the walker's best box. A real second person wholly inside another's box (a child
    in front of an adult) covers less of it (0.41 in the test's case). ``iou >= 1`` and
    ``nested=None`` keep every box."""
    if len(dets) < 2 or (iou >= 1.0 and nested is None):
        return dets
    import torch

    boxes = torch.tensor([d.box for d in dets], dtype=torch.float32)
    scores = torch.tensor([d.conf for d in dets], dtype=torch.float32)
    classes = torch.tensor([d.cls for d in dets])
    keep = list(range(len(dets)))
    if iou < 1.0:
        from torchvision.ops import batched_nms

        keep = sorted(batched_nms(boxes, scores, classes, iou).tolist())
    if nested is not None and len(keep) > 1:
        b, sc, cl = boxes[keep], scores[keep], classes[keep]
        lo = torch.maximum(b[:, None, :2], b[None, :, :2])
        hi = torch.minimum(b[:, None, 2:], b[None, :, 2:])
        inter = (hi - lo).clamp(min=0).prod(-1)  # [i, j]: box i's area inside box j
        area = (b[:, 2:] - b[:, :2]).clamp(min=0).prod(-1)
        inside = inter >= nested * area[:, None]
        same_class = cl[:, None] == cl[None, :]
        part = inside & same_class & (sc[None, :] >= NESTED_SCORE_RATIO * sc[:, None])
        # [i, j]: i inside j covering half of it, or j inside i so: one object, in either order
        same = inside & same_class & (area[:, None] >= NESTED_SAME_OBJECT_IOU * area[None, :])
        same = same | same.T
        part |= same & (sc[None, :] > sc[:, None])
        part.fill_diagonal_(False)
        keep = [k for k, is_part in zip(keep, part.any(dim=1).tolist(), strict=True) if not is_part]
    return [dets[i] for i in keep]


def _check_export_imgsz(weights: str, imgsz: int) -> None:
    """An export has a fixed input size; a different ``detector.imgsz`` would fail per frame."""
    import yaml

    path = Path(weights)
    meta = (path if path.is_dir() else path.parent) / "metadata.yaml"
    exported = None
    if meta.is_file():
        exported = (yaml.safe_load(meta.read_text()) or {}).get("imgsz")
    elif path.suffix == ".onnx":
        try:
            import onnx

            props = {
                p.key: p.value
                for p in onnx.load(str(path), load_external_data=False).metadata_props
            }
            exported = yaml.safe_load(props.get("imgsz", "null"))
        except Exception:  # no onnx package or no metadata: ultralytics will say at predict
            exported = None
    if exported and max(exported) != imgsz:
        raise DetectorError(
            f"detector.imgsz: {imgsz}, but {weights!r} was exported for {max(exported)}; set "
            f"detector.imgsz: {max(exported)} or export again with --imgsz {imgsz}"
        )


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
