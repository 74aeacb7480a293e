"""The config file: defaults, field-naming errors, environment overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.config import ConfigError, load_config, parse_config

pytestmark = pytest.mark.timeout(30)

EXAMPLE = """
redis_url: redis://redis:6379/0
cameras:
  - id: front-door
    url: rtsp://user:pw@10.0.0.5:554/stream1
    fps: 2
    prompt: Who is at the door?
    detector: {conf: 0.4}
  - {id: lobby, url: /videos/lobby.mp4, fps: 1}
  - {id: usb, url: 0}
detector: {weights: yolo26n.yaml, imgsz: 320}
describer: {base_url: "http://vlm:8000/v1", model: tiny}
"""


def test_example_file_loads_with_defaults(tmp_path: Path) -> None:
    path = tmp_path / "cameras.yaml"
    path.write_text(EXAMPLE)
    config = load_config(path)
    assert [c.id for c in config.cameras] == ["front-door", "lobby", "usb"]
    assert config.cameras[2].url == 0 and not config.cameras[2].is_file
    assert config.cameras[1].is_file and not config.cameras[0].is_file
    assert config.detector.classes == [0]  # person by default
    assert config.describer.priority == "batch"
    assert config.prompt_for("front-door") == "Who is at the door?"
    assert config.prompt_for("lobby") == config.describer.prompt


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"cameras": [{"id": "a", "url": "rtsp://x", "fps": 0}]}, "cameras.0.fps"),
        ({"cameras": [{"id": "bad id", "url": "rtsp://x"}]}, "cameras.0.id"),
        ({"cameras": [{"id": "a", "url": "ftp://x"}]}, "cameras.0.url"),
        ({"cameras": [{"id": "a"}]}, "cameras.0.url"),
        ({"gate": {"cooldwn_s": 3}}, "gate.cooldwn_s"),
        ({"detector": {"conf": 1.5}}, "detector.conf"),
        ({"queue": {"maxlen": 1}}, "queue.maxlen"),
        ({"redis_url": "localhost:6379"}, "redis_url"),
    ],
)
def test_invalid_values_are_errors_that_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data, "cameras.yaml")
    assert f"  {field}:" in str(err.value)
    assert str(err.value).startswith("cameras.yaml: invalid configuration")


def test_duplicate_camera_ids_are_rejected() -> None:
    cams = [{"id": "a", "url": "rtsp://x"}, {"id": "a", "url": "rtsp://y"}]
    with pytest.raises(ConfigError, match="duplicate camera id 'a'"):
        parse_config({"cameras": cams})


def test_environment_overrides_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "cameras.yaml"
    path.write_text(EXAMPLE)
    monkeypatch.setenv("VS_REDIS_URL", "redis://elsewhere:6380/1")
    monkeypatch.setenv("VS_DESCRIBER__API_KEY", "secret")
    monkeypatch.setenv("VS_GATE__COOLDOWN_S", "42")
    config = load_config(path)
    assert config.redis_url == "redis://elsewhere:6380/1"
    assert config.describer.api_key == "secret"
    assert config.describer.model == "tiny"  # the rest of the section still comes from the file
    assert config.gate.cooldown_s == 42


def test_the_shipped_example_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "pipelines" / "cameras.example.yaml"
    config = load_config(example)
    assert config.cameras and config.describer.model


def test_unreadable_or_malformed_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("cameras: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_describer_max_pixels_defaults_to_none_and_is_validated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse_config({}).describer.max_pixels is None  # frames are sent as queued
    config = parse_config({"describer": {"max_pixels": 200704}})
    assert config.describer.max_pixels == 200704
    for bad in (0, -5, "many"):
        with pytest.raises(ConfigError) as err:
            parse_config({"describer": {"max_pixels": bad}}, "cameras.yaml")
        assert "  describer.max_pixels:" in str(err.value)
    monkeypatch.setenv("VS_DESCRIBER__MAX_PIXELS", "50176")
    assert parse_config({}).describer.max_pixels == 50176
