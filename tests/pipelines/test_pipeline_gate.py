"""The gate: people present, cooldown, and changes in the number of people."""

from __future__ import annotations

import pytest

from pipelines.config import GateConfig
from pipelines.gate import Gate

pytestmark = pytest.mark.timeout(30)


def decisions(gate: Gate, frames: list[tuple[float, int]], camera: str = "cam") -> list[str]:
    out = []
    for now, persons in frames:
        verdict = gate.decide(camera, persons, now)
        out.append(verdict.reason if verdict.send else f"skip:{verdict.reason}")
    return out


def test_frames_without_people_are_skipped() -> None:
    gate = Gate(GateConfig(min_persons=1))
    assert decisions(gate, [(0, 0), (1, 0)]) == ["skip:too_few_persons"] * 2


def test_first_frame_with_people_is_sent_then_cooldown_applies() -> None:
    gate = Gate(GateConfig(min_persons=1, cooldown_s=10, min_interval_s=1))
    got = decisions(gate, [(0, 1), (3, 1), (9.9, 1), (10, 1), (12, 1)])
    assert got == ["first", "skip:cooldown", "skip:cooldown", "cooldown_elapsed", "skip:cooldown"]


def test_a_change_in_person_count_skips_the_cooldown_but_not_the_min_interval() -> None:
    gate = Gate(GateConfig(min_persons=1, cooldown_s=60, min_interval_s=1, send_on_change=True))
    got = decisions(gate, [(0, 1), (0.5, 2), (1.5, 2), (2.5, 2), (3.5, 1)])
    # the change at 0.5 s is inside the floor; it is still news at 1.5 s
    assert got == ["first", "skip:min_interval", "count_changed", "skip:cooldown", "count_changed"]


def test_people_returning_to_an_empty_scene_are_news() -> None:
    gate = Gate(GateConfig(min_persons=1, cooldown_s=60, min_interval_s=0))
    got = decisions(gate, [(0, 1), (5, 0), (6, 1)])
    assert got == ["first", "skip:too_few_persons", "count_changed"]


def test_change_trigger_can_be_disabled() -> None:
    gate = Gate(GateConfig(min_persons=1, cooldown_s=60, min_interval_s=0, send_on_change=False))
    assert decisions(gate, [(0, 1), (5, 3)]) == ["first", "skip:cooldown"]


def test_cameras_are_gated_independently() -> None:
    gate = Gate(GateConfig(min_persons=1, cooldown_s=60))
    assert decisions(gate, [(0, 1)], "a") == ["first"]
    assert decisions(gate, [(1, 1)], "b") == ["first"]
    assert decisions(gate, [(2, 1)], "a") == ["skip:cooldown"]


def test_min_persons_zero_sends_empty_scenes_on_cooldown() -> None:
    gate = Gate(GateConfig(min_persons=0, cooldown_s=2, min_interval_s=0))
    assert decisions(gate, [(0, 0), (1, 0), (2, 0)]) == [
        "first",
        "skip:cooldown",
        "cooldown_elapsed",
    ]
