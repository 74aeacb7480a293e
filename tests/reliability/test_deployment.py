"""The compose deployment is locked down: every container is health-checked, log-rotated,
limited and unprivileged; the server needs an API key and is published on loopback only;
Redis needs a password and is not published; the secrets are required variables that reach
each process through its environment, under the names the code reads.

Read from ``compose.yaml`` with PyYAML (no Docker needed); where the ``docker compose``
client is installed, it validates the file too. No container is started.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"
DOCKERFILE = REPO / "Dockerfile"
SERVICES = {"redis", "vlm", "pipeline", "describer", "ui", "mosquitto", "notifier"}
APP_SERVICES = {"vlm", "pipeline", "describer", "ui", "notifier"}  # our image
SECRETS = {
    "VISION_SERVE_API_KEY": "the-api-key",
    "REDIS_PASSWORD": "the-redis-password",
    "UI_API_KEY": "the-ui-api-key",
}
# what each process serves inside its container, and the route its healthcheck asks
HEALTH_ROUTES = {
    "vlm": "http://127.0.0.1:8000/health",
    "pipeline": "http://127.0.0.1:9101/metrics",
    "describer": "http://127.0.0.1:9102/metrics",
    "notifier": "http://127.0.0.1:9103/metrics",  # profile notify: tests/notify
    "ui": "http://127.0.0.1:8080/health",  # its port: tests/events/test_events_deployment.py
}


# the variable that sets the port of each process whose probe asks its metrics port
PORT_VARIABLES = {
    "pipeline": "VS_METRICS__PIPELINE_PORT",
    "describer": "VS_METRICS__DESCRIBE_PORT",
    "notifier": "VS_NOTIFY__METRICS_PORT",
}


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?message}``, enough for this file."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2) or "", match.group(3) or ""
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg

    return re.sub(r"(?<!\$)\$\{(\w+)(?:(:[-?])([^}]*))?\}", one, value).replace("$$", "$")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    """The service's environment with the secrets set (and defaults for the rest)."""
    return {k: interpolate(str(v), SECRETS) for k, v in service.get("environment", {}).items()}


def test_the_stack_is_redis_vlm_pipeline_and_describers(services):
    assert set(services) == SERVICES


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_has_a_healthcheck(services, name):
    check = services[name].get("healthcheck")
    assert check and not check.get("disable"), name
    assert check["test"][0] in ("CMD", "CMD-SHELL")
    assert {"interval", "timeout", "retries"} <= set(check)


@pytest.mark.parametrize("name", sorted(APP_SERVICES))
def test_app_healthchecks_use_python_and_the_port_the_process_serves(services, name):
    """The image has python, not curl; a probe on another port than the process's fails."""
    test = services[name]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    assert HEALTH_ROUTES[name] in test[3]
    if name in PORT_VARIABLES:  # the config file must not move the probe's port
        port = HEALTH_ROUTES[name].split(":")[2].split("/")[0]
        assert env_of(services[name])[PORT_VARIABLES[name]] == port


def test_redis_healthcheck_authenticates_without_putting_the_password_in_argv(services):
    kind, command = services["redis"]["healthcheck"]["test"]
    assert kind == "CMD-SHELL"
    assert "REDISCLI_AUTH=" in command and " -a " not in command
    assert "grep -q PONG" in command  # redis-cli exits 0 on a NOAUTH error


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_rotates_its_logs(services, name):
    logging = services[name]["logging"]
    assert logging["driver"] == "json-file"
    assert logging["options"]["max-size"] and int(logging["options"]["max-file"]) >= 1


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_runs_without_privileges(services, name):
    service = services[name]
    assert "no-new-privileges:true" in service["security_opt"]
    assert service["cap_drop"] == ["ALL"]
    assert not service.get("cap_add") and not service.get("privileged")
    assert service["read_only"] is True
    assert any(t.split(":")[0] == "/tmp" for t in service["tmpfs"])


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_has_memory_and_pids_limits(services, name):
    service = services[name]
    limits = service.get("deploy", {}).get("resources", {}).get("limits", {})
    assert service.get("mem_limit") or limits.get("memory"), name
    assert service.get("pids_limit") or limits.get("pids"), name


def test_our_image_runs_as_a_non_root_user():
    users = re.findall(r"^USER\s+(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    assert users, "no USER in the Dockerfile: the processes would run as root"
    assert users[-1].split(":")[0] not in ("root", "0")


def test_redis_runs_as_the_images_redis_user(services):
    """With cap_drop ALL, the redis image's root entrypoint could not chown and switch user."""
    assert services["redis"]["user"] == "redis"


def dockerfile_env() -> dict[str, str]:
    """The ``KEY=value`` pairs of the Dockerfile's ENV lines."""
    return dict(
        re.findall(r"^(?:ENV)?\s*(\w+)=(\S+?)\s*\\?$", DOCKERFILE.read_text(), re.MULTILINE)
    )


def test_every_directory_the_apps_write_is_tmpfs_or_a_volume(services):
    env = dockerfile_env()
    tmp_dirs = [env["YOLO_CONFIG_DIR"], env["MPLCONFIGDIR"]]
    cache_dirs = [env["VISION_SERVE_CACHE_DIR"], env["TORCH_EXTENSIONS_DIR"]]  # serve only

    def writable(service: dict[str, Any]) -> list[PurePosixPath]:
        tmpfs = [t.split(":")[0] for t in service["tmpfs"]]
        mounts = [interpolate(v, SECRETS).split(":") for v in service["volumes"]]
        return [PurePosixPath(p) for p in tmpfs + [m[1] for m in mounts if m[2:] != ["ro"]]]

    for name in APP_SERVICES:
        dirs = tmp_dirs + (cache_dirs if name == "vlm" else [])
        roots = writable(services[name])
        for d in map(PurePosixPath, dirs):
            assert any(d == r or r in d.parents for r in roots), (name, d)


def test_the_server_is_published_on_loopback_only(services):
    (port,) = services["vlm"]["ports"]
    assert port.startswith("127.0.0.1:") and port.endswith(":8000")


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_published_port_is_on_loopback(services, name):
    for port in services[name].get("ports", []):
        assert isinstance(port, str) and port.startswith("127.0.0.1:"), (name, port)


def test_redis_is_not_published_and_shares_no_network_with_the_server(services):
    assert "ports" not in services["redis"]
    assert not set(services["redis"]["networks"]) & set(services["vlm"]["networks"])
    assert set(services["describer"]["networks"]) >= {
        *services["redis"]["networks"],
        *services["vlm"]["networks"],
    }


def test_the_secrets_are_required_variables_wherever_they_are_used():
    text = COMPOSE.read_text()
    for name in SECRETS:
        uses = re.findall(r"(?<!\$)\$\{" + name + r"([^}]*)\}", text)
        assert uses, name
        assert all(use.startswith(":?") and len(use) > 2 for use in uses), (name, uses)


def test_redis_requires_the_password_and_reads_it_from_stdin(services):
    redis = services["redis"]
    script = redis["command"][-1]
    assert "requirepass $$REDIS_PASSWORD" in script  # expanded by the container's shell
    assert "--requirepass" not in script and "exec redis-server" in script
    assert re.search(r"redis-server [^\n]* - <<", script)  # "-": config from stdin
    assert env_of(redis)["REDIS_PASSWORD"] == SECRETS["REDIS_PASSWORD"]


def test_the_server_takes_the_api_key_from_the_variable_it_reads(services, monkeypatch):
    from vision_serve.settings import ServerSettings

    assert not any("api-key" in str(arg) for arg in services["vlm"]["command"])  # not in `ps`
    for key, value in env_of(services["vlm"]).items():
        monkeypatch.setenv(key, value)
    assert ServerSettings().api_key == SECRETS["VISION_SERVE_API_KEY"]


@pytest.mark.parametrize("name", ["pipeline", "describer"])
def test_camera_processes_get_the_redis_password_under_the_names_they_read(
    services, monkeypatch, name
):
    from pipelines.config import parse_config

    for key in list(os.environ):
        if key.startswith("VS_"):
            monkeypatch.delenv(key)
    for key, value in env_of(services[name]).items():
        monkeypatch.setenv(key, value)
    config = parse_config({})
    assert config.redis_url == f"redis://:{SECRETS['REDIS_PASSWORD']}@redis:6379/0"
    if name == "describer":
        assert config.describer.api_key == SECRETS["VISION_SERVE_API_KEY"]
        assert config.describer.base_url == "http://vlm:8000/v1"
    else:
        assert "VS_DESCRIBER__API_KEY" not in services[name]["environment"]  # least privilege


def test_the_build_context_holds_only_what_the_dockerfile_copies():
    """``.dockerignore`` excludes everything first, so a ``.env`` with the secrets, the venv or
    checkpoints never reach the build (or the image)."""
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    copied = {
        src.rstrip("/")
        for line in re.findall(r"^COPY\s+(.+)$", DOCKERFILE.read_text(), re.MULTILINE)
        for src in line.split()[:-1]
        if not src.startswith("--")
    }
    allowed = {p[1:].strip("/") for p in patterns if p.startswith("!")}
    assert allowed == copied


SAFE_LOAD_CHECK = """
import sys
from pathlib import Path

import torch
from ultralytics import YOLO

out, files = Path(sys.argv[1]), sys.argv[2:]
if not (out / "planted.pt").exists():
    YOLO("yolo26n.yaml").save(out / "real.pt")


    class Payload:  # unpickling it calls open(marker, "w"): code run by loading a file
        def __reduce__(self):
            return (open, (str(out / "payload-ran"), "w"))

    torch.save({"model": Payload()}, out / "planted.pt")
for name in files:
    try:
        YOLO(out / name)
    except Exception as exc:
        print(name, "refused", type(exc).__name__)
    else:
        print(name, "loaded")
"""


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_the_image_loads_yolo_weights_without_running_pickled_code(tmp_path):
    """A ``.pt`` is a pickle: by default loading one runs whatever it holds. The image's
    ``ULTRALYTICS_SAFE_LOAD`` loads real checkpoints and refuses a planted one unrun."""
    image_env = dockerfile_env()
    assert image_env["ULTRALYTICS_SAFE_LOAD"] == "1"
    base = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(tmp_path / "yolo")}
    base.pop("ULTRALYTICS_SAFE_LOAD", None)

    def load(env: dict[str, str], *files: str) -> list[str]:
        cmd = [sys.executable, "-c", SAFE_LOAD_CHECK, str(tmp_path), *files]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return [line for line in done.stdout.splitlines() if line.split(" ")[0] in files]

    safe = {**base, "ULTRALYTICS_SAFE_LOAD": image_env["ULTRALYTICS_SAFE_LOAD"]}
    results = load(safe, "real.pt", "planted.pt")
    assert results[0] == "real.pt loaded"
    assert results[1].startswith("planted.pt refused")
    assert not (tmp_path / "payload-ran").exists()
    load(base, "planted.pt")  # the threat is real: without the flag the payload runs
    assert (tmp_path / "payload-ran").exists()


# --- the docker compose client -------------------------------------------------------------
def _docker_compose(env_overrides: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    env.update(env_overrides)
    # --env-file /dev/null: a developer's .env must not supply what the test leaves out
    cmd = ["docker", "compose", "--env-file", "/dev/null", "-f", str(COMPOSE), "config", "-q"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_docker_compose_accepts_the_file_with_the_secrets_set(docker_compose):
    result = _docker_compose(SECRETS)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_docker_compose_refuses_to_start_without_a_secret_and_says_which(docker_compose, missing):
    result = _docker_compose({k: v for k, v in SECRETS.items() if k != missing})
    assert result.returncode != 0
    assert f"set {missing}" in result.stderr
