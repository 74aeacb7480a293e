"""``benchmarks/pipeline.py --capacity --quick`` runs end to end, so it cannot rot: the
trained detector (``vision-serve make-detector``; built once per machine, which is why this
is in the slow tier) exported per format, probed through the real pipeline, Redis and a
describer; a table, a JSON and a PNG come out. The figures themselves depend on the machine
and its load, so only their shape and consistency are checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_capacity_quick_probes_each_format_and_saves_json_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    cmd = [sys.executable, "benchmarks/pipeline.py", "--capacity", "--quick"]
    cmd += ["--formats", "pt", "onnx", "--imgsz", "160", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "cameras x fps" in proc.stdout  # the table was printed
    (path,) = tmp_path.glob("pipeline-capacity-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    result = json.loads(path.read_text())
    assert result["setup"]["quick"] and result["setup"]["fps_per_camera"] == 2
    assert result["setup"]["weights"].endswith(".pt")  # the trained detector's build
    rows = result["rows"]
    assert [(r["format"], r["imgsz"]) for r in rows] == [("pt", 160), ("onnx", 160)]
    for row in rows:
        assert 1 <= len(row["probes"]) <= 2 and row["single_frame_ms"] > 0
        for p in row["probes"]:
            assert p["detected"] > 0 and p["ms_per_frame"] > 0 and p["mean_batch"] >= 1
            assert p["target_fps"] == 2 * p["cameras"]
        sustained = [p["cameras"] for p in row["probes"] if p["sustained"]]
        assert row["sustained_cameras"] == max(sustained, default=0)
        assert row["sustained_frames_per_s"] == 2 * row["sustained_cameras"]
