"""Detector ms/frame per format: PyTorch (.pt), ONNX Runtime, OpenVINO, at several imgsz.

The trained synthetic-person detector (``vision-serve make-detector``, built once if absent)
is exported per imgsz and loaded through the pipeline's own ``Detector``, then times one
640x480 synthetic frame per call (the pipeline's batch of one camera), the formats taking
turns frame by frame. A short run: 3 warm-up calls, then ``--frames`` timed ones per format
and size (about a minute in all).

    python -m benchmarks.detector [--imgsz 320 640] [--frames 30] [--formats pt onnx openvino]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import log, save_json


def frames(count: int) -> list[np.ndarray]:
    from pipelines import synthetic

    rng = np.random.default_rng(123)
    return [synthetic.frame(rng, (640, 480), persons=2)[0] for _ in range(count)]


def weights_for(fmt: str, pt: Path, imgsz: int, work: Path) -> str:
    if fmt == "pt":
        return str(pt)
    from pipelines.detector_export import export_detector

    folder = work / f"{fmt}-{imgsz}"
    folder.mkdir()
    source = folder / "best.pt"
    shutil.copy2(pt, source)
    return str(export_detector(source, fmt, imgsz))


def load(weights: str, imgsz: int):
    from pipelines.config import DetectorConfig
    from pipelines.detect import Detector

    return Detector(DetectorConfig(weights=weights, imgsz=imgsz, device="cpu"))


def time_round_robin(detectors: dict[str, object], images: list[np.ndarray]) -> dict[str, dict]:
    """Each frame through every format in turn, so load from other processes on a shared
    machine hits all formats alike instead of whichever happened to run then."""
    from pipelines.ingest import Frame

    times: dict[str, list[float]] = {name: [] for name in detectors}
    persons = dict.fromkeys(detectors, 0)
    for i, image in enumerate(images[:3] + images):
        frame = [Frame("bench", i, time.time(), image)]
        for name, detector in detectors.items():
            started = time.perf_counter()
            found = len(detector.detect(frame)[0])
            if i >= 3:  # the first three are warm-up
                times[name].append((time.perf_counter() - started) * 1000)
                persons[name] += found
    return {
        name: {
            "ms_per_frame_median": round(statistics.median(t), 2),
            "ms_per_frame_mean": round(statistics.fmean(t), 2),
            "persons_per_frame": round(persons[name] / len(images), 2),
        }
        for name, t in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", help=".pt detector (default: make-detector's cached build)")
    ap.add_argument("--imgsz", type=int, nargs="+", default=[320, 640])
    ap.add_argument("--formats", nargs="+", default=["pt", "onnx", "openvino"])
    ap.add_argument("--frames", type=int, default=30)
    ap.add_argument("--out", default="detector.json")
    args = ap.parse_args()
    os.environ.setdefault("YOLO_OFFLINE", "1")
    if args.weights:
        pt = Path(args.weights)
    else:
        from pipelines.detector_training import make_detector

        pt = Path(make_detector(log=log).weights)
    import torch

    images = frames(args.frames)
    rows = []
    with tempfile.TemporaryDirectory(prefix="detector-bench-") as tmp:
        for imgsz in args.imgsz:
            detectors = {}
            for fmt in args.formats:
                log(f"{fmt} at imgsz {imgsz}: exporting/loading")
                detectors[fmt] = load(weights_for(fmt, pt, imgsz, Path(tmp)), imgsz)
            log(f"imgsz {imgsz}: timing {args.frames} frames per format, round robin")
            for fmt, timing in time_round_robin(detectors, images).items():
                rows.append({"format": fmt, "imgsz": imgsz, **timing})
                log(f"  {rows[-1]}")
    print(f"{'format':<10} {'imgsz':>5} {'ms/frame p50':>13} {'mean':>8} {'persons':>8}")
    for r in rows:
        print(
            f"{r['format']:<10} {r['imgsz']:>5} {r['ms_per_frame_median']:>13.1f} "
            f"{r['ms_per_frame_mean']:>8.1f} {r['persons_per_frame']:>8.2f}"
        )
    save_json(
        args.out,
        {
            "weights": str(pt),
            "frames": args.frames,
            "frame_size": [640, 480],
            "torch_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "load_avg_1m": os.getloadavg()[0],
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
