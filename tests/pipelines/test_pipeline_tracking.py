"""Tracking, the per-track gate, zones and filters, on a generated clip of people from
Ultralytics' ``bus.jpg`` walking across a background.

Boxes come from ``DifferenceDetector`` (what moves in the frames), then go through the real
pipeline stages: masks and filters, Ultralytics' ByteTrack / BoT-SORT tracker per camera,
the gate, and the queue item (crop, fields, prompt). No Redis is needed here:
``CameraPipeline.process`` is the per-frame path ``step`` runs after the detector.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any

import cv2
import numpy as np
import pytest
from clip_helpers import SIZE, DifferenceDetector, Walker, frames
from pipeline_helpers import build_config

from pipelines import metrics
from pipelines.config import ConfigError
from pipelines.detect import Detection
from pipelines.pipeline import CameraPipeline
from pipelines.queue import Outgoing, QueueConfig, encode_entry
from pipelines.vlm import build_prompt

pytestmark = pytest.mark.timeout(60)

# A walks along the ground (bottom half), B along the top band; B appears 6 frames later
A = Walker(0, start=(10, 240), end=(520, 250), first=0, last=29)
B = Walker(1, start=(480, 10), end=(40, 20), first=6, last=29, scale=0.6)
GROUND = {"coordinates": "0,0.6,1,0.6,1,1,0,1"}  # relative: the bottom 40 % of the frame


def pipeline_for(camera: dict[str, Any] | None = None, **sections: Any) -> CameraPipeline:
    cam = {"id": "cam", "url": "clip.mp4", **(camera or {})}
    config = build_config("redis://127.0.0.1:1/0", cameras=[cam], **sections)
    return CameraPipeline(config, DifferenceDetector())


def run_clip(
    pipeline: CameraPipeline, walkers: list[Walker], count: int, fps: float = 2.0
) -> tuple[list[Outgoing], list[list[Detection]]]:
    """Every frame through the detector stand-in and ``process``; the items to send and
    each frame's detections as the gate saw them (tracked)."""
    sent: list[Outgoing] = []
    seen: list[list[Detection]] = []
    for frame in frames(walkers, count, fps=fps):
        dets = pipeline.detector.detect([frame])[0]
        sent += pipeline.process(frame, dets)
        seen.append(pipeline.last_detections["cam"])
    return sent, seen


def gate_count(decision: str, reason: str, camera: str = "cam") -> float:
    return metrics.GATE_DECISIONS.labels(camera, decision, reason)._value.get()


def track_ids_by_walker(seen: list[list[Detection]]) -> dict[str, set[int | None]]:
    """The track ids given to each walker (told apart by box height: B is smaller)."""
    out: dict[str, set[int | None]] = defaultdict(set)
    for dets in seen[1:]:
        for det in dets:
            out["A" if det.box[3] - det.box[1] > 160 else "B"].add(det.track_id)
    return out


@pytest.mark.parametrize("tracker", ["bytetrack", "botsort"])
def test_track_ids_are_stable_across_the_clip(tracker: str) -> None:
    pipeline = pipeline_for({"gate": {"describe_on": ["track_start"]}}, tracker={"type": tracker})
    _, seen = run_clip(pipeline, [A, B], 30)
    ids = track_ids_by_walker(seen)
    # B's first frame is unconfirmed (None) -- ByteTrack confirms a track on its 2nd match
    assert len(ids["A"]) == 1 and None not in ids["A"], ids
    assert len(ids["B"] - {None}) == 1, ids
    assert ids["A"].isdisjoint(ids["B"])


def test_one_description_per_track_not_per_frame() -> None:
    per_frame = pipeline_for({"gate": {"cooldown_s": 0, "min_interval_s": 0}})
    frame_sent, _ = run_clip(per_frame, [A, B], 30)
    assert len(frame_sent) == 30  # the per-frame gate (no cooldown): every frame

    per_track = pipeline_for({"gate": {"describe_on": ["track_start"], "min_frames": 3}})
    sent, seen = run_clip(per_track, [A, B], 30)
    ids = track_ids_by_walker(seen)
    assert [item.gate_reason for item in sent] == ["track_start", "track_start"]
    assert {item.tracks for item in sent} == {tuple(ids["A"]), tuple(ids["B"] - {None})}
    assert gate_count("skip", "already_described") > 0


def test_a_track_outside_the_required_zone_is_never_described() -> None:
    before = gate_count("skip", "outside_zones")
    pipeline = pipeline_for(
        {
            "gate": {"describe_on": ["track_start", "track_end"], "lost_frames": 2},
            "zones": {"ground": GROUND},
            "required_zones": ["ground"],
        }
    )
    gone = Walker(1, start=(480, 10), end=(40, 20), first=2, last=20, scale=0.6)
    sent, seen = run_clip(pipeline, [A, gone], 30)
    ids = track_ids_by_walker(seen)
    described = {t for item in sent for t in item.tracks}
    assert described == ids["A"]  # B walked the top band only: never described, not even at its end
    assert gate_count("skip", "outside_zones") > before


def test_track_end_sends_the_last_frame_the_track_was_seen_in() -> None:
    walker = Walker(0, start=(10, 240), end=(300, 250), first=0, last=9)
    pipeline = pipeline_for(
        {"gate": {"describe_on": ["track_start", "track_end"], "lost_frames": 3}}
    )
    sent, _ = run_clip(pipeline, [walker], 20)
    assert [item.gate_reason for item in sent] == ["track_start", "track_end"]
    end = sent[1]
    assert end.frame.seq == 10 and end.suffix == "end"  # frame index 9: its last
    assert end.tracks == sent[0].tracks


def test_max_descriptions_caps_a_track() -> None:
    walker = Walker(0, start=(10, 240), end=(300, 250), first=0, last=9)
    pipeline = pipeline_for(
        {
            "gate": {
                "describe_on": ["track_start", "track_end"],
                "lost_frames": 3,
                "max_descriptions": 1,
            }
        }
    )
    sent, _ = run_clip(pipeline, [walker], 20)
    assert [item.gate_reason for item in sent] == ["track_start"]


def test_interval_redescribes_a_long_lived_track() -> None:
    still = Walker(0, start=(200, 240), end=(204, 240), first=0, last=59)
    pipeline = pipeline_for(
        {
            "gate": {
                "describe_on": ["track_start", "interval"],
                "interval_s": 10,
                "max_descriptions": 3,
            }
        }
    )
    sent, _ = run_clip(pipeline, [still], 60, fps=2.0)  # 30 s
    reasons = [item.gate_reason for item in sent]
    assert reasons == ["track_start", "track_interval", "track_interval"]
    times = [item.frame.ts for item in sent]
    assert times[1] - times[0] >= 10 and times[2] - times[1] >= 10


def test_per_frame_gating_counts_only_people_in_required_zones() -> None:
    pipeline = pipeline_for(
        {"zones": {"ground": GROUND}, "required_zones": ["ground"], "gate": {"cooldown_s": 60}}
    )
    top_only = Walker(1, start=(480, 10), end=(40, 20), first=0, last=9, scale=0.6)
    sent, _ = run_clip(pipeline, [top_only], 10)
    assert sent == []
    assert gate_count("skip", "too_few_persons") > 0


def test_masks_and_filters_drop_what_they_should() -> None:
    before = Counter(
        {
            r: metrics.DETECTIONS_FILTERED.labels("cam", r)._value.get()
            for r in ("mask", "min_area", "max_ratio", "min_score")
        }
    )
    pipeline = pipeline_for(
        {
            "objects": {
                "mask": ["0,0,0.2,0,0.2,1,0,1"],  # left fifth of the frame
                "filters": {
                    "person": {"min_area": 2000, "max_ratio": 1.5, "min_score": 0.5},
                    "car": {"min_area": 0.5},  # another class: its own bounds
                },
            }
        }
    )
    image = np.zeros((SIZE[1], SIZE[0], 3), np.uint8)
    dets = [
        Detection(0, "person", 0.9, (20, 100, 100, 300)),  # feet in the mask
        Detection(0, "person", 0.9, (300, 100, 320, 150)),  # 1000 px < min_area
        Detection(0, "person", 0.9, (300, 300, 600, 400)),  # 3:1, wider than max_ratio
        Detection(0, "person", 0.3, (300, 100, 400, 300)),  # below min_score
        Detection(0, "person", 0.9, (400, 100, 480, 300)),  # kept
        Detection(2, "car", 0.9, (300, 100, 400, 300)),  # < half the frame: dropped
    ]
    kept = pipeline.zones["cam"].filter(dets, (image.shape[1], image.shape[0]))
    assert [d.box for d in kept] == [(400, 100, 480, 300)]
    after = {r: metrics.DETECTIONS_FILTERED.labels("cam", r)._value.get() for r in before}
    assert {r: after[r] - before[r] for r in before} == {
        "mask": 1,
        "min_area": 2,
        "max_ratio": 1,
        "min_score": 1,
    }


def test_zone_membership_is_the_bottom_centre_of_the_box() -> None:
    from pipelines.zones import CameraZones

    config = build_config(
        "redis://127.0.0.1:1/0",
        cameras=[
            {
                "id": "cam",
                "url": "x.mp4",
                "zones": {
                    "door": {"coordinates": GROUND["coordinates"], "objects": ["person"]},
                    "px": {"coordinates": [[0, 0], [100, 0], [100, 100], [0, 100]]},
                },
            }
        ],
    )
    zones = CameraZones(config.cameras[0])
    tall = Detection(0, "person", 0.9, (300, 10, 340, 400))  # mostly above, feet inside
    high = Detection(0, "person", 0.9, (300, 10, 340, 200))
    car = Detection(2, "car", 0.9, (300, 10, 340, 400))
    corner = Detection(0, "person", 0.9, (10, 10, 50, 90))
    assert zones.zones_of(tall, SIZE) == ["door"]
    assert zones.zones_of(high, SIZE) == []
    assert zones.zones_of(car, SIZE) == []  # the zone counts persons only
    assert zones.zones_of(corner, SIZE) == ["px"]  # pixel coordinates


def test_crop_view_sends_the_padded_track_box_and_the_prompt_names_the_track() -> None:
    pipeline = pipeline_for(
        {
            "gate": {"describe_on": ["track_start"]},
            "describer": {"view": "crop", "crop_padding": 0.25},
        }
    )
    sent, _ = run_clip(pipeline, [A], 10)
    assert len(sent) == 1
    item = sent[0]
    x1, y1, x2, y2 = item.crop
    box = next(d.box for d in item.detections if d.track_id in item.tracks)
    assert x1 < box[0] and y1 <= box[1] and x2 > box[2] and y2 >= box[3]
    jpeg, fields = encode_entry(item, QueueConfig())
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert image.shape[1] == x2 - x1 and image.shape[0] == y2 - y1  # fewer pixels, fewer tokens
    assert json.loads(fields["tracks"]) == list(item.tracks)
    boxes = json.loads(fields["boxes"])
    assert boxes[0]["track_id"] == item.tracks[0]
    assert boxes[0]["box"][0] == pytest.approx(box[0] - x1, abs=0.1)
    prompt = build_prompt("Describe.", fields)
    assert f"Tracked (new): person #{item.tracks[0]}" in prompt
    assert f"region {fields['crop']} of the 640x480 camera frame" in prompt


def test_zone_view_crops_to_the_zone() -> None:
    pipeline = pipeline_for({"zones": {"ground": GROUND}, "describer": {"view": "zone"}})
    sent, _ = run_clip(pipeline, [A], 2)
    assert sent[0].crop == (0, 288, 640, 480)


def test_entries_without_tracking_keep_their_old_fields() -> None:
    pipeline = pipeline_for()
    sent, _ = run_clip(pipeline, [A], 1)
    _, fields = encode_entry(sent[0], QueueConfig())
    assert set(fields) == {"camera", "ts", "seq", "persons", "boxes", "width", "height", "gate"}
    assert "track_id" not in json.loads(fields["boxes"])[0]


@pytest.mark.parametrize(
    ("camera", "message"),
    [
        ({"gate": {"describe_on": ["frame", "track_start"]}}, "cannot be mixed"),
        ({"required_zones": ["door"]}, "no zone named 'door'"),
        ({"zones": {"z": {"coordinates": "0,0,1,1"}}}, "at least 3 points"),
        ({"describer": {"view": "zone"}}, "needs at least one entry in zones"),
        ({"objects": {"filters": {"person": {"min_scor": 1}}}}, "min_scor"),
    ],
)
def test_bad_zone_and_gate_config_is_an_error_naming_the_field(
    camera: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config("redis://127.0.0.1:1/0", cameras=[{"id": "cam", "url": "x", **camera}])


def test_tracker_fields_replace_the_ultralytics_yaml_values() -> None:
    from pipelines.config import TrackerConfig
    from pipelines.tracking import tracker_args

    default = tracker_args(TrackerConfig())
    assert default.fuse_score is True and default.track_high_thresh == 0.25  # bytetrack.yaml
    tuned = tracker_args(
        TrackerConfig(fuse_score=False, track_high_thresh=0.13, new_track_thresh=0.13)
    )
    assert tuned.fuse_score is False
    assert (tuned.track_high_thresh, tuned.new_track_thresh) == (0.13, 0.13)
