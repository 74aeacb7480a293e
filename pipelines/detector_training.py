"""``vision-serve make-detector``: a YOLO26n person detector trained offline, cached.

Why: with no network no trained weights are reachable, and an untrained YOLO26 finds nobody,
so the demo and the end-to-end tests had to bypass the gate. This fine-tunes YOLO26n from
its yaml on synthetic frames (``pipelines.synthetic``: the sample images' people pasted onto
varied backgrounds) for a few minutes on CPU, validates it on held-out synthetic frames and
keeps ``best.pt`` with its metrics under ``~/.cache/vision-serve/detectors/`` -- one entry per
(recipe version, seed), reused when present, as ``make-model`` checkpoints are by the demo.

Offline by construction: ``YOLO_OFFLINE`` / ``YOLO_AUTOINSTALL`` are set before ultralytics is
imported, AMP (whose check fetches weights) and plots (which fetch a font) are off.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipelines import synthetic

RECIPE_VERSION = 4  # bump when the recipe changes: a new cache entry, old ones untouched
# its own variable, not VISION_SERVE_CACHE_DIR: test sessions point that one at a fresh
# temporary directory, and a detector takes minutes to build
DETECTORS_ENV = "VISION_SERVE_DETECTORS_DIR"


@dataclass(frozen=True)
class Recipe:
    """What is trained. Sized for ~4 minutes of training on 2 busy CPU cores."""

    imgsz: int = 192
    frame_size: tuple[int, int] = (256, 192)
    train_frames: int = 400
    val_frames: int = 120
    epochs: int = 7
    batch: int = 16


@dataclass(frozen=True)
class DetectorBuild:
    """A built (or reused) detector: where it is and how well it did on held-out frames."""

    weights: str
    imgsz: int
    conf: float  # the operating threshold: max F1 on the held-out frames
    seed: int
    version: int
    map50: float
    map50_95: float
    precision: float
    recall: float
    train_s: float
    total_s: float
    reused: bool = False

    def tracker_settings(self) -> dict[str, Any]:
        """The ``tracker:`` fields this detector needs. Its scores sit near its threshold
        (0.1-0.4 where COCO weights give 0.6-0.9): ByteTrack's default IoU x score matching
        (``fuse_score``) then never confirms a track's second frame, and its 0.25 bar for a
        new track leaves many people untracked; both follow this operating threshold."""
        return {"fuse_score": False, "track_high_thresh": self.conf, "new_track_thresh": self.conf}

    def summary(self) -> str:
        state = "reused" if self.reused else f"built in {self.total_s:.0f}s"
        return (
            f"detector {state}: {self.weights} (imgsz {self.imgsz}); held-out synthetic frames: "
            f"mAP50 {self.map50:.3f}, mAP50-95 {self.map50_95:.3f}; at conf {self.conf:.2f} "
            f"(max F1): precision {self.precision:.3f}, recall {self.recall:.3f}"
        )


def detectors_root() -> Path:
    """``$VISION_SERVE_DETECTORS_DIR`` or ``~/.cache/vision-serve/detectors``: kept across
    runs (and CI steps, where the CI caches it)."""
    default = Path.home() / ".cache" / "vision-serve" / "detectors"
    return Path(os.environ.get(DETECTORS_ENV) or default)


def detector_dir(seed: int = 0, version: int = RECIPE_VERSION) -> Path:
    return detectors_root() / f"yolo26n-synthetic-v{version}-s{seed}"


def _offline() -> None:
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_AUTOINSTALL", "False")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder per cache entry: a second process waits, then finds the entry built."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_build(out: Path) -> DetectorBuild | None:
    """The build recorded in ``out/metrics.json``, if its weights are there too."""
    meta = out / "metrics.json"
    if not (out / "best.pt").is_file() or not meta.is_file():
        return None
    data = json.loads(meta.read_text())
    data.update(weights=str(out / "best.pt"), reused=True)
    return DetectorBuild(**data)


def make_detector(
    seed: int = 0,
    out: Path | None = None,
    recipe: Recipe | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> DetectorBuild:
    """The cached detector for ``seed``, trained first if absent (or ``force``)."""
    out = Path(out) if out is not None else detector_dir(seed)
    with _locked(out.parent / f".{out.name}.lock"):
        if not force and (found := load_build(out)) is not None:
            return found
        return _build(seed, out, recipe or Recipe(), log)


def _build(seed: int, out: Path, recipe: Recipe, log: Callable[[str], None]) -> DetectorBuild:
    _offline()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-build-", dir=out.parent))
    try:
        log(
            f"make-detector: writing {recipe.train_frames}+{recipe.val_frames} synthetic frames "
            f"(seed {seed}) under {work}"
        )
        data = synthetic.write_dataset(
            work / "data", seed, recipe.train_frames, recipe.val_frames, recipe.frame_size
        )
        log(
            f"make-detector: training YOLO26n from yolo26n.yaml, {recipe.epochs} epochs at imgsz "
            f"{recipe.imgsz} on CPU (a few minutes on 2 cores)"
        )
        train_started = time.monotonic()
        metrics = _train(data, work, seed, recipe)
        train_s = time.monotonic() - train_started
        stage = work / "out"
        stage.mkdir()
        shutil.copy2(work / "run" / "weights" / "best.pt", stage / "best.pt")
        build = DetectorBuild(
            weights=str(out / "best.pt"),
            imgsz=recipe.imgsz,
            seed=seed,
            version=RECIPE_VERSION,
            train_s=round(train_s, 1),
            total_s=round(time.monotonic() - started, 1),
            **metrics,
        )
        record = {k: v for k, v in asdict(build).items() if k not in ("weights", "reused")}
        (stage / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)  # readers see a whole entry or none
        return build
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _train(data: Path, work: Path, seed: int, recipe: Recipe) -> dict[str, float]:
    """Train, then validate ``best.pt`` on the held-out split; the four box metrics."""
    from ultralytics import YOLO

    model = YOLO("yolo26n.yaml")
    model.train(
        data=str(data),
        epochs=recipe.epochs,
        imgsz=recipe.imgsz,
        batch=recipe.batch,
        nbs=recipe.batch,  # a step per batch: the default nominal 64 would accumulate 4
        device="cpu",
        workers=0,
        seed=seed,
        deterministic=True,
        optimizer="AdamW",
        lr0=0.002,
        warmup_epochs=0,  # a short run: ultralytics' 100-iteration warm-up would be all of it
        close_mosaic=2,  # mosaic (4 frames' people per sample) until the last two epochs
        amp=False,  # its check downloads weights
        plots=False,  # plotting downloads a font
        val=False,  # the last epoch is validated anyway
        project=str(work),
        name="run",
        exist_ok=True,
        verbose=False,
    )
    box = _box_metrics(model)
    from ultralytics.utils.metrics import smooth

    best = int(smooth(box.f1_curve.mean(0), 0.1).argmax())  # where ultralytics reads P and R
    return {
        "conf": round(min(max(float(box.px[best]), 0.05), 0.5), 3),
        "map50": round(float(box.map50), 4),
        "map50_95": round(float(box.map), 4),
        "precision": round(float(box.mp), 4),
        "recall": round(float(box.mr), 4),
    }


def _box_metrics(model: Any) -> Any:
    """The final validation ultralytics ran on ``best.pt`` over the val split."""
    return model.trainer.validator.metrics.box
