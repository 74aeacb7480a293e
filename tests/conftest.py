"""Fixtures shared by every test package: offline settings and generated tiny checkpoints."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_AUTOINSTALL", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "VISION_SERVE_CACHE_DIR" not in os.environ:
    # start-up calibrations of this run, not the user's: every session measures afresh once
    import tempfile

    os.environ["VISION_SERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="vision-serve-test-cache-")

from pathlib import Path

import pytest

FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """make_model once per (family, preset) per test session."""
    from engine.checkpoints import make_model

    made: dict[tuple[str, str], Path] = {}

    def get(family: str = "qwen2_vl", preset: str = "tiny") -> Path:
        key = (family, preset)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-{preset}")
            made[key] = make_model(family, preset, out, seed=0)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_qwen2_vl(checkpoint_factory) -> Path:
    return checkpoint_factory("qwen2_vl")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(checkpoint_factory) -> Path:
    return checkpoint_factory("qwen2_5_vl")


# Every family runs in CI; the quick local tier runs the engine tests on the first family only
# (the families share the decoder code; they differ in the vision tower and rotary sections).
FAMILY_PARAMS = [FAMILIES[0], *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES[1:])]


@pytest.fixture(scope="session", params=FAMILY_PARAMS)
def tiny_checkpoint(request, checkpoint_factory) -> Path:
    """Parametrised over both families: a test using it runs once per family."""
    return checkpoint_factory(request.param)


@pytest.fixture(scope="session")
def docker_compose() -> None:
    """Tests of compose.yaml run ``docker compose config``: only the client is needed (no
    engine), but not every machine's client has the compose plugin."""
    import shutil
    import subprocess

    if shutil.which("docker") is None:
        pytest.skip("no docker client on this machine")
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip("the docker client has no compose plugin")
