"""``benchmarks/pipeline.py --gating-compare`` runs end to end on a short clip, so it cannot
rot; per-track gating sends fewer VLM requests than per-frame gating on the same frames."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


def test_gating_compare_counts_fewer_requests_per_track(tmp_path: Path) -> None:
    cmd = [sys.executable, "benchmarks/pipeline.py", "--gating-compare"]
    cmd += ["--gating-minutes", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("pipeline_gating_*.json")
    gatings = json.loads(path.read_text())["gatings"]
    per_frame = gatings["frame (cooldown 10 s, on count change)"]["requests"]
    per_track = gatings["track_start"]["requests"]
    assert 0 < per_track < per_frame
    assert gatings["track_start"]["by_reason"] == {"track_start": per_track}
