"""The compose services of the ``notify`` profile: a Mosquitto that refuses anonymous
clients and is reached from this host only, and a notifier that gets the broker and Redis
credentials under the names it reads. The common hardening (healthcheck, logs, limits,
no privileges) is asserted for every service in ``tests/reliability/test_deployment.py``.

The broker's start script and healthcheck are run here too, against the local ``mosquitto``
with the container paths moved into a temporary folder.
"""

from __future__ import annotations

import getpass
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.pipelines.pipeline_helpers import free_port, kill_group, wait_until
from tests.reliability.test_deployment import COMPOSE, SECRETS, interpolate

NOTIFY_SECRETS = {**SECRETS, "MQTT_PASSWORD": "the-mqtt-password"}


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def env_of(service: dict) -> dict[str, str]:
    return {
        k: interpolate(str(v), NOTIFY_SECRETS) for k, v in service.get("environment", {}).items()
    }


def test_the_broker_and_the_notifier_start_only_with_the_notify_profile(services):
    assert services["mosquitto"]["profiles"] == ["notify"]
    assert services["notifier"]["profiles"] == ["notify"]
    # so a stack without the profile needs no MQTT_PASSWORD: it is checked at start instead
    assert ":?" not in str(services["mosquitto"]["environment"]["MQTT_PASSWORD"])


def test_the_broker_refuses_anonymous_clients_and_is_reached_from_this_host_only(services):
    broker = services["mosquitto"]
    script = broker["command"][-1]
    assert "allow_anonymous false" in script and "password_file /tmp/passwords" in script
    assert "mosquitto_passwd -b" not in script  # the password goes through stdin, not argv
    assert broker["ports"] == ["127.0.0.1:${MQTT_PORT:-1883}:1883"]
    assert broker["networks"] == ["notify"]  # not on the queue network: no way to Redis
    assert broker["user"] != "root"
    # the healthcheck logs in with credentials from an options file, not from its argv
    check = broker["healthcheck"]["test"][1]
    assert "-P" not in check.split("mosquitto_sub ", 1)[1]


def test_the_notifier_reads_redis_and_the_broker_from_its_environment(services, monkeypatch):
    import os

    from pipelines.config import parse_config

    for key in list(os.environ):
        if key.startswith("VS_"):
            monkeypatch.delenv(key)
    for key, value in env_of(services["notifier"]).items():
        monkeypatch.setenv(key, value)
    config = parse_config({})
    assert config.redis_url == f"redis://:{SECRETS['REDIS_PASSWORD']}@redis:6379/0"
    mqtt = config.notify.mqtt
    assert (mqtt.host, mqtt.port, mqtt.username) == ("mosquitto", 1883, "vision-serve")
    assert mqtt.password.get_secret_value() == NOTIFY_SECRETS["MQTT_PASSWORD"]
    assert set(services["notifier"]["networks"]) == {"queue", "notify"}
    assert "VS_DESCRIBER__API_KEY" not in services["notifier"]["environment"]


def _here(text: str, tmp: Path, port: int) -> str:
    """A container command with its paths and port moved into ``tmp`` / ``port``."""
    text = text.replace("$$", "$").replace("/mosquitto/data/", f"{tmp}/data/")
    text = text.replace("/tmp/", f"{tmp}/").replace(
        "XDG_CONFIG_HOME=/tmp", f"XDG_CONFIG_HOME={tmp}"
    )
    text = text.replace("-h 127.0.0.1", f"-h 127.0.0.1 -p {port}")
    # as root, mosquitto would switch to its own user, which cannot read the test's folder
    return text.replace(
        "listener 1883\\n", f"listener {port} 127.0.0.1\\nuser {getpass.getuser()}\\n"
    )


@pytest.mark.timeout(30)
def test_the_brokers_start_script_and_healthcheck_work(services, tmp_path):
    if shutil.which("mosquitto") is None or shutil.which("mosquitto_sub") is None:
        pytest.skip("mosquitto / mosquitto-clients not installed: scripts/install-system-deps.sh")
    broker = services["mosquitto"]
    port = free_port()
    (tmp_path / "data").mkdir()
    env = {"PATH": "/usr/sbin:/usr/bin:/bin", **env_of(broker)}
    script = _here(broker["command"][-1], tmp_path, port)
    proc = subprocess.Popen(
        ["sh", "-c", script], env=env, start_new_session=True, stderr=subprocess.PIPE
    )
    check = _here(broker["healthcheck"]["test"][1], tmp_path, port)

    def healthy(password: str) -> int:
        run_env = {**env, "MQTT_PASSWORD": password}
        return subprocess.run(["sh", "-c", check], env=run_env, timeout=10).returncode

    try:
        wait_until(lambda: healthy(env["MQTT_PASSWORD"]) == 0, 10, interval=0.2, what="healthy")
        assert healthy("a-wrong-password") != 0
        anonymous = ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-t", "#", "-W", "2"]
        assert subprocess.run(anonymous, capture_output=True, timeout=10).returncode != 0
        assert "the-mqtt-password" not in (tmp_path / "passwords").read_text()  # hashed
    finally:
        kill_group(proc)
    without = {**env, "MQTT_PASSWORD": ""}
    refused = subprocess.run(["sh", "-c", script], env=without, capture_output=True, timeout=10)
    assert refused.returncode != 0 and b"set MQTT_PASSWORD" in refused.stderr


def test_docker_compose_lists_the_notify_services_only_with_the_profile(docker_compose):
    def services_listed(*profile: str) -> set[str]:
        cmd = ["docker", "compose", "--env-file", "/dev/null", "-f", str(COMPOSE), *profile]
        done = subprocess.run(
            [*cmd, "config", "--services"],
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", **SECRETS},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return set(done.stdout.split())

    assert not {"mosquitto", "notifier"} & services_listed()
    assert {"mosquitto", "notifier"} <= services_listed("--profile", "notify")
