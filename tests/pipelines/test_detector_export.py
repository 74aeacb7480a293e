"""``vision-serve export-detector`` and loading exports, plus the weights-resolution errors.

Round trip: the trained detector exported to ONNX (and OpenVINO where installed, the
``export`` extra) loads in the pipeline's ``Detector`` and finds the same people, in the same
places, as the ``.pt`` it came from.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import REPO, iou

from pipelines import synthetic
from pipelines.config import DetectorConfig
from pipelines.detect import Detector, DetectorError, resolve_weights
from pipelines.ingest import Frame


def cli(*args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vision_serve.cli", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture(scope="module")
def frames() -> list[Frame]:
    images = [s.image for s in synthetic.samples()]
    rng = np.random.default_rng(99)
    images += [synthetic.frame(rng, (640, 480), persons=1)[0] for _ in range(2)]
    return [Frame("t", i, 0.0, image) for i, image in enumerate(images)]


def assert_same_people(reference: Detector, exported: Detector, frames: list[Frame]) -> None:
    """Every confident box of the .pt is found by the export at IoU > 0.8."""
    for ref, got in zip(reference.detect(frames), exported.detect(frames), strict=True):
        for d in (d for d in ref if d.conf > 0.5):
            assert got and max(iou(d.box, g.box) for g in got) > 0.8, (d, got)


@pytest.mark.parametrize("fmt", ["onnx", "openvino"])
def test_export_round_trip_finds_the_same_people(
    fmt, trained_detector, person_detector, frames, tmp_path
):
    if importlib.util.find_spec(fmt) is None:
        pytest.skip(f"{fmt} not installed (pip install -e '.[export]')")
    weights = tmp_path / "best.pt"
    shutil.copy2(trained_detector.weights, weights)
    proc = cli("export-detector", "--weights", str(weights), "--format", fmt,
               "--imgsz", str(trained_detector.imgsz))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = Path(proc.stdout.strip().splitlines()[-1])
    assert exported.is_dir() if fmt == "openvino" else exported.suffix == ".onnx"
    detector = Detector(DetectorConfig(weights=str(exported), imgsz=trained_detector.imgsz))
    assert detector.names[0] == "person"
    assert_same_people(person_detector, detector, frames)


def test_an_export_refuses_another_imgsz(trained_detector, tmp_path):
    if importlib.util.find_spec("onnx") is None:
        pytest.skip("onnx not installed")
    from pipelines.detector_export import export_detector

    weights = tmp_path / "best.pt"
    shutil.copy2(trained_detector.weights, weights)
    onnx = export_detector(weights, "onnx", trained_detector.imgsz)
    wrong = trained_detector.imgsz + 32
    with pytest.raises(DetectorError, match=rf"detector\.imgsz: {wrong}"):
        Detector(DetectorConfig(weights=str(onnx), imgsz=wrong))


def test_export_cli_names_a_missing_weights_file(tmp_path):
    proc = cli("export-detector", "--weights", str(tmp_path / "nope.pt"), "--format", "onnx")
    assert proc.returncode == 2
    assert "--weights" in proc.stderr and "nope.pt" in proc.stderr


def test_export_cli_rejects_an_unknown_format():
    proc = cli("export-detector", "--format", "tflite")
    assert proc.returncode == 2 and "--format" in proc.stderr


def test_offline_yolo26n_pt_is_an_error_naming_the_file_and_where(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DetectorError) as err:
        resolve_weights("yolo26n.pt")
    message = str(err.value)
    assert "'yolo26n.pt' not found" in message
    assert str(tmp_path / "yolo26n.pt") in message  # where to put it
    assert "detector.download: true" in message and "make-detector" in message
    assert not (tmp_path / "yolo26n.pt").exists()  # nothing was fetched


def test_pipeline_cli_exits_2_on_offline_yolo26n_pt(tmp_path):
    config = tmp_path / "cameras.yaml"
    config.write_text(
        "redis_url: redis://127.0.0.1:1/0\n"
        "cameras: [{id: c, url: /nonexistent.mp4}]\n"
        "detector: {weights: yolo26n.pt}\n"
    )
    proc = cli("pipeline", "--config", str(config), cwd=tmp_path, YOLO_OFFLINE="1")
    assert proc.returncode == 2
    assert "yolo26n.pt" in proc.stderr and "detector.download" in proc.stderr


def test_a_directory_without_an_openvino_model_is_refused(tmp_path):
    with pytest.raises(DetectorError, match="without an OpenVINO model"):
        resolve_weights(str(tmp_path))
