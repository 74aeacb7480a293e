"""The ``ui`` service in compose.yaml: its key, Redis password and VLM key reach it under the
names the code reads; its data dir is a volume; probe, command and published port agree.
(Hardening, limits and logs are asserted for every service in tests/reliability.)"""

from __future__ import annotations

import os

import yaml

from pipelines.events.cli import is_loopback
from tests.reliability.test_deployment import COMPOSE, SECRETS, env_of, interpolate


def ui_service() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]["ui"]


def test_the_ui_reads_its_own_key_the_redis_password_and_the_vlm_key(monkeypatch):
    from pipelines.config import parse_config

    for key in list(os.environ):
        if key.startswith("VS_"):
            monkeypatch.delenv(key)
    for key, value in env_of(ui_service()).items():
        monkeypatch.setenv(key, value)
    config = parse_config({})
    assert config.ui.api_key == SECRETS["UI_API_KEY"] != SECRETS["VISION_SERVE_API_KEY"]
    assert config.redis_url == f"redis://:{SECRETS['REDIS_PASSWORD']}@redis:6379/0"
    assert config.describer.api_key == SECRETS["VISION_SERVE_API_KEY"]
    assert config.describer.base_url == "http://vlm:8000/v1"
    assert config.events.data_dir == "/data/events"


def test_the_ui_keeps_its_data_on_a_named_volume():
    service = ui_service()
    mounts = [interpolate(v, SECRETS).split(":") for v in service["volumes"]]
    (data,) = [m for m in mounts if m[1] == "/data/events"]
    assert data[0] in yaml.safe_load(COMPOSE.read_text())["volumes"] and data[2:] != ["ro"]


def test_the_ui_listens_where_its_probe_and_port_point_and_needs_a_key_there():
    service = ui_service()
    command = service["command"]
    host = command[command.index("--host") + 1]
    port = command[command.index("--port") + 1]
    assert f"http://127.0.0.1:{port}/health" in service["healthcheck"]["test"][3]
    (published,) = service["ports"]
    assert published.startswith("127.0.0.1:") and published.endswith(f":{port}")
    assert not is_loopback(host)  # so the process refuses to start without a key ...
    assert "${UI_API_KEY:?" in COMPOSE.read_text()  # ... and compose without the variable
