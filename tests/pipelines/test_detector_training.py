"""``vision-serve make-detector``: a person detector trained offline that really finds people.

The build itself (minutes on 2 cores) happens once per machine in the session fixture
``trained_detector`` and is cached; these tests check what it produced and how it is reused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import REPO, iou

from pipelines import synthetic
from pipelines.detector_training import load_build, make_detector
from pipelines.ingest import Frame

HELD_OUT_SEED = 424242  # never used by a build: make-detector seeds are small integers


def detect(detector, image: np.ndarray):
    return detector.detect([Frame("t", 0, 0.0, image)])[0]


def test_build_is_recorded_with_its_held_out_map(trained_detector):
    assert Path(trained_detector.weights).is_file()
    meta = json.loads((Path(trained_detector.weights).parent / "metrics.json").read_text())
    assert meta["map50"] == trained_detector.map50 and 0.0 <= meta["map50"] <= 1.0
    assert meta["imgsz"] == trained_detector.imgsz


def test_finds_a_pasted_person_with_the_right_box(person_detector):
    """Held-out frames (a seed no build uses), one pasted person each, at the build's
    threshold: a good share found in the right place (held-out recall is ~0.5, so not all)."""
    rng = np.random.default_rng(HELD_OUT_SEED)
    hits = 0
    for _ in range(10):
        image, (truth,) = synthetic.frame(rng, (640, 480), persons=1)
        found = detect(person_detector, image)
        if found and max(iou(d.box, truth) for d in found) > 0.5:
            hits += 1
    assert hits >= 4, hits  # deterministic: same weights, same frames


def test_finds_the_people_of_the_sample_images(person_detector):
    """The test videos' frames (bus, zidane at 640x480): persons found in both, so
    ``min_persons: 1`` passes them, and overlapping real people."""
    for sample in synthetic.samples():
        found = detect(person_detector, sample.image)
        assert found, sample.name
        best = max(iou(d.box, truth) for d in found for truth in sample.persons)
        assert best > 0.3, (sample.name, found)


def test_finds_nobody_on_empty_backgrounds(person_detector):
    rng = np.random.default_rng(HELD_OUT_SEED + 1)
    empty = [synthetic.background(rng, (640, 480)) for _ in range(6)]
    empty.append(np.full((480, 640, 3), 96, np.uint8))  # the test video's grey frame
    found = [detect(person_detector, image) for image in empty]
    assert sum(1 for f in found if f) <= 1, found
    assert not found[-1]


def test_a_second_make_detector_reuses_the_cache(trained_detector):
    again = make_detector(log=lambda _m: None)
    assert again.reused and again.weights == trained_detector.weights
    assert again.map50 == trained_detector.map50


def test_cli_prints_the_weights_path_last_and_exits_0(trained_detector):
    proc = subprocess.run(
        [sys.executable, "-m", "vision_serve.cli", "make-detector"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == trained_detector.weights
    assert "mAP50" in proc.stderr


def test_cli_exits_1_when_it_cannot_build(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = subprocess.run(
        [sys.executable, "-m", "vision_serve.cli", "make-detector", "--out", str(blocker / "d")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "make-detector failed" in proc.stderr
    assert load_build(blocker / "d") is None


@pytest.mark.parametrize("persons", [0, 2])
def test_synthetic_frames_are_deterministic(persons):
    a = synthetic.frame(np.random.default_rng(7), (160, 120), persons=persons)
    b = synthetic.frame(np.random.default_rng(7), (160, 120), persons=persons)
    assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    assert len(a[1]) <= persons
