"""``vision-serve ui``: config errors and an unauthenticated non-loopback listener are refused
before anything starts; the key can come from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.config import parse_config
from pipelines.events.cli import is_loopback
from tests.pipelines.pipeline_helpers import write_config
from vision_serve.cli import main


def ui_config(tmp_path: Path, **ui) -> Path:
    config = parse_config({"events": {"data_dir": str(tmp_path / "events")}, "ui": ui})
    return write_config(tmp_path / "cameras.yaml", config)


def test_listening_beyond_loopback_without_a_key_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("VS_UI__API_KEY", raising=False)
    path = ui_config(tmp_path)
    assert main(["ui", "--config", str(path), "--host", "0.0.0.0"]) == 2
    assert "ui.api_key (or VS_UI__API_KEY) is required" in capsys.readouterr().err
    assert not (tmp_path / "events").exists()  # refused before the store was created


def test_an_unknown_key_in_the_ui_section_is_an_error_naming_it(tmp_path, capsys):
    path = tmp_path / "cameras.yaml"
    path.write_text("ui:\n  api_kee: secret\n")
    assert main(["ui", "--config", str(path)]) == 2
    assert "ui.api_kee" in capsys.readouterr().err


def test_the_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("VS_UI__API_KEY", "from-env")
    assert parse_config({"ui": {"api_key": "from-file"}}).ui.api_key == "from-env"
    monkeypatch.setenv("VS_UI__API_KEY", "  ")
    assert parse_config({}).ui.api_key is None  # blank is no key, not a key of spaces


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", False), ("ui", False)],
)
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback
