"""Zone inertia and loitering (Frigate's ``zones.<name>.inertia`` / ``loitering_time``): the
rules of ``pipelines.presence`` frame by frame, then through the per-track gate with its
skip reasons counted, and the configuration check that keeps them off per-frame cameras.

The gate tests feed ``TrackGate`` tracked detections directly (a box whose bottom centre is
inside or outside the zone on each frame), so each frame's verdict is known exactly.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from pipeline_helpers import build_config

from pipelines import metrics
from pipelines.config import ConfigError, ZoneConfig
from pipelines.detect import Detection
from pipelines.gate import TrackGate, Trigger
from pipelines.ingest import Frame
from pipelines.presence import TrackZones
from pipelines.zones import CameraZones

pytestmark = pytest.mark.timeout(30)

GROUND = "0,0.6,1,0.6,1,1,0,1"  # the bottom 40 % of a 640x480 frame (y >= 288)
IN_BOX = (300.0, 200.0, 340.0, 400.0)  # feet at y 400: inside
OUT_BOX = (300.0, 40.0, 340.0, 240.0)  # feet at y 240: outside
IMAGE = np.zeros((480, 640, 3), np.uint8)
FPS = 2.0


def track_zones(inertia: int = 3, loitering_time: float = 0) -> TrackZones:
    zone = ZoneConfig(coordinates=GROUND, inertia=inertia, loitering_time=loitering_time)
    return TrackZones({"ground": zone})


def places(zones: TrackZones, feet: str, start: float = 0.0) -> list[str]:
    """The place after each frame of ``feet``: ``I`` inside, ``o`` outside, one per frame
    ``1 / FPS`` s apart."""
    return [
        zones.update(["ground"] if f == "I" else [], start + i / FPS)["ground"]
        for i, f in enumerate(feet)
    ]


def test_an_object_is_in_the_zone_after_inertia_frames_inside() -> None:
    assert places(track_zones(inertia=3), "IIII") == ["inertia", "inertia", "in", "in"]


def test_inertia_counts_frames_in_a_row() -> None:
    # a frame outside before the third restarts the count
    assert places(track_zones(inertia=3), "IIoIII") == [
        "inertia",
        "inertia",
        "outside",
        "inertia",
        "inertia",
        "in",
    ]


def test_an_excursion_shorter_than_inertia_keeps_the_object_in() -> None:
    zones = track_zones(inertia=3)
    assert places(zones, "IIIooIoo")[2:] == ["in"] * 6
    assert zones.entered == {"ground"}


def test_inertia_frames_outside_take_it_out_and_reentry_counts_again() -> None:
    zones = track_zones(inertia=3)
    assert places(zones, "IIIooo")[-1] == "outside"
    assert places(zones, "III", start=10) == ["inertia", "inertia", "in"]
    assert zones.entered == {"ground"}  # in once: stays recorded (Frigate's entered_zones)


def test_inertia_one_follows_the_frame() -> None:
    assert places(track_zones(inertia=1), "IoI") == ["in", "outside", "in"]


def test_loitering_time_is_counted_from_the_first_frame_inside() -> None:
    zones = track_zones(inertia=2, loitering_time=2.0)
    # frames 0.5 s apart: inside from t=0, present at t=0.5, 2 s spent at t=2.0
    assert places(zones, "IIIIIII") == ["inertia"] + ["loitering"] * 3 + ["in"] * 3


def test_a_stay_that_ends_restarts_the_loitering_clock() -> None:
    zones = track_zones(inertia=1, loitering_time=2.0)
    assert places(zones, "IIIoIIIII") == [
        "loitering",
        "loitering",
        "loitering",
        "outside",  # left at t=1.5 (inertia 1) before its 2 s
        "loitering",
        "loitering",
        "loitering",
        "loitering",
        "in",  # t=4.0: 2 s since it came back at t=2.0
    ]
    assert zones.entered == {"ground"}


def test_a_label_the_zone_does_not_take_is_never_in_it() -> None:
    config = build_config(
        "redis://127.0.0.1:1/0",
        cameras=[
            {
                "id": "cam",
                "url": "x.mp4",
                "gate": {"describe_on": ["track_start"]},
                "zones": {"ground": {"coordinates": GROUND, "objects": ["car"], "inertia": 1}},
            }
        ],
    )
    zones = CameraZones(config.cameras[0])
    presence = TrackZones(zones.zones)
    person = Detection(0, "person", 0.9, IN_BOX, track_id=1)
    assert presence.update(zones.zones_of(person, (640, 480)), 0.0)["ground"] == "outside"


# --- through the per-track gate ---------------------------------------------------------------

_cameras = itertools.count()


def track_gate(zone: dict[str, Any], **gate: Any) -> TrackGate:
    """A per-track gate (track_start) for a camera whose required zone is ``ground``."""
    camera_id = f"zp{next(_cameras)}"
    config = build_config(
        "redis://127.0.0.1:1/0",
        cameras=[
            {
                "id": camera_id,
                "url": "x.mp4",
                "gate": {"describe_on": ["track_start"], "min_interval_s": 0, **gate},
                "zones": {"ground": {"coordinates": GROUND, **zone}},
                "required_zones": ["ground"],
            }
        ],
    )
    camera = config.cameras[0]
    return TrackGate(camera_id, config.gate_for(camera_id), CameraZones(camera))


def run(gate: TrackGate, feet: str, track_id: int = 1) -> list[list[Trigger]]:
    """Track ``track_id`` on one frame per letter of ``feet`` (``I`` inside, ``o`` outside,
    ``.`` not detected); each frame's triggers."""
    out = []
    for i, f in enumerate(feet):
        frame = Frame(gate.camera_id, i + 1, 1000.0 + i / FPS, IMAGE)
        dets = [] if f == "." else [Detection(0, "person", 0.9, IN_BOX if f == "I" else OUT_BOX)]
        dets = [Detection(d.cls, d.label, d.conf, d.box, track_id) for d in dets]
        out.append(gate.decide(frame, dets))
    return out


def sent_on(triggers: list[list[Trigger]]) -> list[int]:
    """The frame indices that sent a track_start."""
    return [i for i, ts in enumerate(triggers) for t in ts if t.verdict.reason == "track_start"]


def skips(gate: TrackGate, reason: str) -> float:
    return metrics.GATE_DECISIONS.labels(gate.camera_id, "skip", reason)._value.get()


def test_a_track_is_described_on_its_inertia_th_frame_in_the_required_zone() -> None:
    gate = track_gate({"inertia": 4}, min_frames=1)
    assert sent_on(run(gate, "ooIIIIII")) == [5]  # frames 2-5 inside: the 4th is frame 5
    assert skips(gate, "outside_zones") == 2
    assert skips(gate, "zone_inertia") == 3


def test_a_flicker_into_the_zone_shorter_than_inertia_is_never_described() -> None:
    gate = track_gate({"inertia": 3}, min_frames=1)
    assert sent_on(run(gate, "oIIoIIoIIo")) == []
    assert skips(gate, "zone_inertia") == 6
    assert skips(gate, "outside_zones") == 4


def test_a_brief_excursion_does_not_make_a_described_track_new() -> None:
    gate = track_gate({"inertia": 3}, describe_on=["track_start", "interval"], interval_s=2)
    sent = run(gate, "IIIoIIIII")
    assert sent_on(sent) == [2]
    # the excursion (frame 3) kept it in: the interval clock ran on, and it was due at t=3.0
    reasons = [(i, t.verdict.reason) for i, ts in enumerate(sent) for t in ts]
    assert reasons == [(2, "track_start"), (6, "track_interval")]
    assert skips(gate, "outside_zones") == 0


def test_missed_frames_neither_count_nor_reset_inertia() -> None:
    gate = track_gate({"inertia": 3}, min_frames=1)
    assert sent_on(run(gate, "I..I.I")) == [5]


def test_loitering_time_holds_the_description_until_spent() -> None:
    gate = track_gate({"inertia": 1, "loitering_time": 3}, min_frames=1)
    assert sent_on(run(gate, "IIIIIIII")) == [6]  # inside from t=0: 3 s at frame 6
    assert skips(gate, "loitering") == 6


def test_a_walker_passing_through_a_loitering_zone_is_never_described() -> None:
    gate = track_gate(
        {"inertia": 1, "loitering_time": 3}, describe_on=["track_start", "track_end"], lost_frames=2
    )
    sent = run(gate, "ooIIIIoooo...")  # 1.5 s inside, then gone
    assert [t for ts in sent for t in ts] == []  # not even a track_end: it never qualified
    assert skips(gate, "loitering") == 4


@pytest.mark.parametrize(
    ("min_frames", "inertia", "first"),
    [(5, 1, 4), (1, 5, 4), (3, 3, 2), (2, 4, 3)],
)
def test_min_frames_and_inertia_count_side_by_side(
    min_frames: int, inertia: int, first: int
) -> None:
    # walking in the zone from its first frame: described when both are met
    gate = track_gate({"inertia": inertia}, min_frames=min_frames)
    assert sent_on(run(gate, "IIIIIIII")) == [first]


def test_min_frames_counts_frames_outside_the_zone_too() -> None:
    # significant after 3 frames anywhere; in the zone after 2 of its frames there
    gate = track_gate({"inertia": 2}, min_frames=3)
    assert sent_on(run(gate, "oooIII")) == [4]
    assert skips(gate, "not_significant") == 2


# --- configuration ----------------------------------------------------------------------------


def camera(zone: dict[str, Any], gate: dict[str, Any] | None = None) -> dict[str, Any]:
    cam = {"id": "cam", "url": "x.mp4", "zones": {"ground": {"coordinates": GROUND, **zone}}}
    return {**cam, "gate": gate} if gate is not None else cam


@pytest.mark.parametrize(
    ("zone", "field"), [({"inertia": 3}, "inertia"), ({"loitering_time": 5}, "loitering_time")]
)
def test_zone_timing_on_a_per_frame_camera_is_an_error_naming_the_field(
    zone: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=rf"zones\.ground\.{field}: counts a tracked object"):
        build_config("redis://127.0.0.1:1/0", cameras=[camera(zone)])


@pytest.mark.parametrize(
    ("zone", "gate", "global_gate"),
    [
        ({}, None, None),  # the default inertia: per-frame cameras judge each frame alone
        ({"inertia": 1}, None, None),  # what a per-frame gate does anyway
        ({"inertia": 5, "loitering_time": 2}, {"describe_on": ["track_start"]}, None),
        ({"inertia": 5}, None, {"describe_on": ["track_end"]}),  # tracked by the global gate
    ],
)
def test_zone_timing_is_accepted_where_it_applies(
    zone: dict[str, Any], gate: dict[str, Any] | None, global_gate: dict[str, Any] | None
) -> None:
    sections = {"gate": global_gate} if global_gate else {}
    config = build_config("redis://127.0.0.1:1/0", cameras=[camera(zone, gate)], **sections)
    assert config.cameras[0].zones["ground"].inertia == zone.get("inertia", 3)


@pytest.mark.parametrize(
    ("zone", "message"),
    [({"inertia": 0}, "greater than or equal to 1"), ({"loitering_time": -1}, "greater than")],
)
def test_bad_inertia_or_loitering_time_is_an_error(zone: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(
            "redis://127.0.0.1:1/0", cameras=[camera(zone, {"describe_on": ["track_start"]})]
        )
