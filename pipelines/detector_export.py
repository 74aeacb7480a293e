"""``vision-serve export-detector``: a ``.pt`` detector as ONNX or OpenVINO, for faster CPUs.

Why: on a CPU the same YOLO26 graph often runs faster under ONNX Runtime or OpenVINO than
under PyTorch eager (``benchmarks/detector.py`` measures it); the pipeline loads either
export as ``detector.weights`` (an ``.onnx`` file, an ``*_openvino_model/`` directory). The
export runs offline: the needed packages come from the ``export`` extra
(``pip install -e '.[export]'``), never installed on the fly.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

FORMATS = {"onnx": ("onnx", "onnxslim", "onnxruntime"), "openvino": ("openvino",)}


class ExportError(RuntimeError):
    """The export cannot run; the message says what to install or pass."""


def missing_packages(fmt: str) -> list[str]:
    return [name for name in FORMATS[fmt] if importlib.util.find_spec(name) is None]


def export_detector(weights: str | Path, fmt: str, imgsz: int, out: Path | None = None) -> Path:
    """Export ``weights`` (a ``.pt``) for a fixed ``imgsz``; returns the ``.onnx`` file or the
    ``*_openvino_model/`` directory (beside the weights, or moved to ``out``)."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_AUTOINSTALL", "False")
    if fmt not in FORMATS:
        raise ExportError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    source = Path(weights).expanduser()
    if source.suffix != ".pt" or not source.is_file():
        raise ExportError(f"--weights: {str(weights)!r} is not an existing .pt file")
    if missing := missing_packages(fmt):
        raise ExportError(
            f"--format {fmt} needs {', '.join(missing)}: pip install -e '.[export]' "
            "(this command never installs packages itself)"
        )
    from ultralytics import YOLO

    try:
        exported = Path(
            YOLO(str(source)).export(format=fmt, imgsz=imgsz, device="cpu", dynamic=False)
        )
    except Exception as exc:
        raise ExportError(f"exporting {source} to {fmt} failed: {exc}") from exc
    if out is None or out.resolve() == exported.resolve():
        return exported
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(exported), str(out))
    return out
