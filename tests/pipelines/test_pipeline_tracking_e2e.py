"""A file camera playing a generated clip, end to end: detector -> tracker -> per-track gate
with a required zone -> Redis -> describer -> an OpenAI-compatible endpoint.

THE DETECTOR: ``clip_detector`` is the ``DifferenceDetector`` (boxes from what moves in the
frames); the trackers, the gate and the zones are the real ones. Asserted: one description per
track, never one per frame, and never a track that stayed out of the required zone.

The endpoint is the recording double, because the test counts and reads the requests the VLM
would get (how many, the prompt, the image size); the describer path against our own server
is covered by ``test_pipeline_e2e.py``.
"""

from __future__ import annotations

import base64
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from clip_helpers import DifferenceDetector, Walker, write_clip
from pipeline_helpers import DescriberThread, descriptions, pending_count, wait_until

from pipelines import metrics
from pipelines.pipeline import CameraPipeline
from pipelines.queue import read_stats

pytestmark = pytest.mark.timeout(120)

FPS = 4
FRAMES = 40  # 10 s
# A walks along the ground (the required zone), B along the top band (outside it)
A = Walker(0, start=(10, 240), end=(520, 250), first=0, last=FRAMES - 1)
B = Walker(1, start=(480, 10), end=(40, 20), first=0, last=FRAMES - 1, scale=0.6)


@pytest.fixture(scope="module")
def clip_detector() -> Any:
    """The ``DifferenceDetector``: boxes from what moves (deterministic, no training). The
    trained YOLO26n (``vision-serve make-detector``) finds these walkers too weakly for the
    tracker to confirm their tracks in the required zone (no description at all in a trial
    run), so it is not used here yet; the RTSP end-to-end test runs it."""
    return DifferenceDetector()


def test_each_track_in_the_zone_is_described_once(
    tmp_path: Path, redis_server: Any, vlm_double: Any, make_config: Any, clip_detector: Any
) -> None:
    clip = write_clip(tmp_path / "clip.mp4", [A, B], FRAMES, FPS)
    config = make_config(
        redis_server.url,
        cameras=[
            {
                "id": "yard",
                "url": str(clip),
                "fps": FPS,
                "loop": False,
                "gate": {"describe_on": ["track_start"], "min_frames": 2, "min_interval_s": 0},
                "zones": {"ground": {"coordinates": "0,0.6,1,0.6,1,1,0,1"}},
                "required_zones": ["ground"],
                "describer": {"view": "crop"},
            }
        ],
        describer={"base_url": vlm_double.base_url},
    )
    outside_before = metrics.GATE_DECISIONS.labels("yard", "skip", "outside_zones")._value.get()
    client = redis_server.client()
    worker = DescriberThread(config, "track-e2e").start()
    pipeline = CameraPipeline(config, clip_detector)
    thread = threading.Thread(target=pipeline.run, daemon=True)
    thread.start()
    try:
        reader = pipeline.readers["yard"]
        wait_until(lambda: reader.stats.sampled >= FRAMES - 4, 60, what="the clip played")
        wait_until(lambda: pipeline.detected["yard"] >= FRAMES // 2, 30, what="frames detected")
    finally:
        pipeline.stop()
        thread.join(20)
    try:
        wait_until(
            lambda: (
                pipeline.queue.enqueued == len(descriptions(client, config.queue))
                and pending_count(client, config.queue) == 0
            ),
            60,
            what="every enqueued frame described",
        )
    finally:
        worker.stop()

    got = descriptions(client, config.queue)
    prompts = [
        next(p["text"] for p in r["messages"][0]["content"] if p["type"] == "text")
        for r in vlm_double.requests
    ]
    tracked = Counter(
        int(n) for p in prompts for n in re.findall(r"person #(\d+) at", p.split("Tracked")[-1])
    )
    assert got and len(vlm_double.requests) == len(got)  # one VLM request per description
    assert len(got) < pipeline.detected["yard"] / 4  # per track, not per frame
    assert tracked and max(tracked.values()) == 1, tracked  # each track described once
    assert read_stats(client, config.queue)["described"] == len(got)
    # B walked the top band the whole clip: skipped as outside the zone, never described
    after = metrics.GATE_DECISIONS.labels("yard", "skip", "outside_zones")._value.get()
    assert after > outside_before
    for request in vlm_double.requests:
        url = request["messages"][0]["content"][0]["image_url"]["url"]
        jpeg = base64.b64decode(url.split(",", 1)[1])
        image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
        assert image.shape[0] * image.shape[1] < 640 * 480 / 2  # the crop, not the frame
        # the crop is around A, on the ground: its bottom edge is in the lower part
    for prompt in prompts:
        assert "Tracked (new): person #" in prompt and "camera frame" in prompt
