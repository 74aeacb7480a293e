"""``benchmarks/detector.py`` runs end to end on a tiny configuration, so it cannot rot.

An untrained YOLO26n saved as ``.pt`` stands in for the trained detector (timings and
detections mean nothing here); every format the script times must load and answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_detector_benchmark_script(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("openvino")
    weights = tmp_path / "untrained.pt"
    save = f"from ultralytics import YOLO; YOLO('yolo26n.yaml').save({str(weights)!r})"
    env = {**os.environ, "YOLO_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", save], check=True, cwd=tmp_path, env=env, timeout=120)
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.detector", "--weights", str(weights),
         "--imgsz", "64", "--frames", "2", "--out", "d.json"],
        cwd=ROOT,
        env={**env, "VISION_SERVE_RESULTS": str(results)},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((results / "d.json").read_text())["rows"]
    assert {r["format"] for r in rows} == {"pt", "onnx", "openvino"}
    assert all(r["imgsz"] == 64 and r["ms_per_frame_median"] > 0 for r in rows)
