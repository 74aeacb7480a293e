"""A file camera playing a generated clip, end to end: detector -> tracker -> per-track gate
with a required zone -> Redis -> describer -> an OpenAI-compatible endpoint.

Two detectors. ``test_each_track_in_the_zone_is_described_once`` (fast tier) takes its boxes
from what moves in the frames (``DifferenceDetector``) and reads the requests the recording
double got. ``test_real_detections_...`` (slow tier) runs the trained YOLO26n of
``vision-serve make-detector`` on a clip of the very cut-outs it was trained on, against our
own ``vision-serve serve``: track ids stable along each walk, one description per track, none
of the person who walks outside the required zone, and the zone's inertia respected.

Why that detector needs its own ``tracker:`` settings (``DetectorBuild.tracker_settings``):
its scores sit at 0.15-0.4, and ByteTrack's defaults (match on IoU x score, new tracks from
0.25) never confirmed a track's second frame -- the reason this test once had to use the
difference detector.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from clip_helpers import Cutout, DifferenceDetector, Walker, iou, write_clip, write_cutout_clip
from pipeline_helpers import (
    DescriberThread,
    descriptions,
    wait_all_described,
    wait_until,
)

from pipelines import metrics
from pipelines.detect import Detection
from pipelines.ingest import Frame
from pipelines.pipeline import CameraPipeline
from pipelines.queue import read_stats
from pipelines.zones import bottom_centre

FPS = 4
FRAMES = 40  # 10 s
# A walks along the ground (the required zone), B along the top band (outside it)
A = Walker(0, start=(10, 240), end=(520, 250), first=0, last=FRAMES - 1)
B = Walker(1, start=(480, 10), end=(40, 20), first=0, last=FRAMES - 1, scale=0.6)


@pytest.fixture(scope="module")
def clip_detector() -> Any:
    """The ``DifferenceDetector``: boxes from what moves (deterministic, no training)."""
    return DifferenceDetector()


@pytest.mark.timeout(120)
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
        wait_all_described(pipeline, client, config.queue, 60, "every enqueued frame described")
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


# --- on the trained detector ------------------------------------------------------------------

# A walks left to right into the yard (the right 55 % of the frame: its feet cross x=288
# around frame 16); B appears at frame 22 and walks slowly along the left, never in the yard,
# never overlapping A. Sizes and background are those the detector was trained on (people
# 25-95 % of the frame's height); at 192 px of input these find each walker in nearly every
# frame at scores 0.15-0.4.
CUT_FRAMES = 40  # 10 s at 4 fps
PEOPLE = {
    "A": Cutout(1, height=300, feet_y=460, start_x=40, end_x=470, first=0, last=CUT_FRAMES - 1),
    "B": Cutout(0, height=280, feet_y=450, start_x=0, end_x=60, first=22, last=CUT_FRAMES - 1),
}
YARD = "0.45,0,1,0,1,1,0.45,1"
INERTIA = 3


class RecordingPipeline(CameraPipeline):
    """The real pipeline, keeping each frame's detections as the gate saw them (tracked)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: dict[int, list[Detection]] = {}  # frame seq -> detections

    def process(self, frame: Frame, dets: list[Detection]) -> Any:
        out = super().process(frame, dets)
        self.seen[frame.seq] = self.last_detections[frame.camera_id]
        return out


def whose(det: Detection, index: int) -> str | None:
    """The walker a detection of clip frame ``index`` found (box overlap), if any."""
    for name, cutout in PEOPLE.items():
        box = cutout.box(index)
        if box is not None and iou(det.box, box) >= 0.4:
            return name
    return None


@pytest.mark.timeout(600)  # the first run on a machine trains the detector (cached after)
def test_real_detections_give_stable_tracks_described_once_in_the_zone(
    tmp_path: Path,
    redis_server: Any,
    vlm_server: str,
    make_config: Any,
    trained_detector: Any,
    person_detector: Any,
) -> None:
    clip = write_cutout_clip(tmp_path / "walk.mp4", list(PEOPLE.values()), CUT_FRAMES, FPS)
    config = make_config(
        redis_server.url,
        cameras=[
            {
                "id": "walk",
                "url": str(clip),
                "fps": 2 * FPS,  # above the clip's rate: every frame is sampled, seq = index + 1
                "loop": False,
                "gate": {"describe_on": ["track_start"], "min_frames": 2, "min_interval_s": 0},
                "zones": {"yard": {"coordinates": YARD, "inertia": INERTIA}},
                "required_zones": ["yard"],
            }
        ],
        tracker=trained_detector.tracker_settings(),
        describer={"base_url": vlm_server, "model": "tiny", "max_tokens": 8, "timeout_s": 60},
    )
    before = {
        r: metrics.GATE_DECISIONS.labels("walk", "skip", r)._value.get()
        for r in ("outside_zones", "zone_inertia")
    }
    client = redis_server.client()
    worker = DescriberThread(config, "walk-e2e").start()
    pipeline = RecordingPipeline(config, person_detector)
    thread = threading.Thread(target=pipeline.run, daemon=True)
    thread.start()
    try:
        reader = pipeline.readers["walk"]
        wait_until(lambda: reader.stats.sampled >= CUT_FRAMES, 60, what="the clip played")
        wait_until(  # each sampled frame detected, or dropped with its reason
            lambda: (
                pipeline.detected["walk"] + sum(reader.stats.dropped.values())
                >= reader.stats.sampled
            ),
            30,
            what="every sampled frame detected",
        )
    finally:
        pipeline.stop()
        thread.join(20)
    try:
        wait_all_described(pipeline, client, config.queue, 120, "every enqueued frame described")
    finally:
        worker.stop()

    # the detector found each walker on (nearly) every detected frame it is in
    ids: dict[str, Counter[int | None]] = {name: Counter() for name in PEOPLE}
    visible: Counter[str] = Counter()
    for seq, dets in pipeline.seen.items():
        index = seq - 1
        visible.update(n for n, c in PEOPLE.items() if c.box(index) is not None)
        found = {whose(d, index): d.track_id for d in sorted(dets, key=lambda d: d.conf)}
        for name in PEOPLE:
            if name in found:
                ids[name][found[name]] += 1
    for name in PEOPLE:
        assert ids[name].total() >= 0.8 * visible[name], (name, ids[name], visible[name])
    # ... with one track id for most of its walk (a new track's first frame has none)
    main = {name: ids[name].most_common(1)[0][0] for name in PEOPLE}
    for name in PEOPLE:
        assert main[name] is not None and ids[name][main[name]] >= 0.8 * visible[name], ids
    assert main["A"] != main["B"]

    # one description per track, for A only: B never set foot in the yard
    entries = [fields for _id, fields in client.xrange(config.queue.frames_stream)]
    sent = [(int(f[b"seq"]), json.loads(f[b"tracks"]), f[b"gate"].decode()) for f in entries]
    described = Counter(t for _seq, tracks, _gate in sent for t in tracks)
    assert described and max(described.values()) == 1, sent  # each track once
    assert {gate for _s, _t, gate in sent} == {"track_start"}
    assert main["A"] in described and main["B"] not in described, (main, sent)
    a_ids = {t for t in ids["A"] if t is not None}
    assert set(described) <= a_ids, (described, ids)  # nothing described but A's tracks
    got = descriptions(client, config.queue)
    assert len(got) == len(sent) and read_stats(client, config.queue)["described"] == len(got)
    assert all(d["text"] for d in got)  # our server answered each

    # inertia: A was described on its INERTIA-th frame in the yard or later, not on entering
    zone_x = 0.45 * 640
    a_seq = next(seq for seq, tracks, _g in sent if main["A"] in tracks)
    a_frames = sorted(
        (seq, bottom_centre(d.box)[0] >= zone_x)
        for seq, dets in pipeline.seen.items()
        for d in dets
        if d.track_id == main["A"] and seq <= a_seq
    )
    assert a_frames[-1] == (a_seq, True)
    assert not a_frames[0][1]  # it walked in from outside the yard
    inside_run = len(a_frames) - max(i for i, (_s, inside) in enumerate(a_frames) if not inside) - 1
    assert inside_run >= INERTIA, a_frames
    after = {r: metrics.GATE_DECISIONS.labels("walk", "skip", r)._value.get() for r in before}
    assert after["zone_inertia"] >= before["zone_inertia"] + INERTIA - 1
    assert after["outside_zones"] > before["outside_zones"]  # B, and A before the yard
