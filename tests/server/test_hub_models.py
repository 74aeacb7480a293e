"""``--model org/name``: a Hub id resolved through the standard Hugging Face cache, offline.

The cache is laid out exactly as ``huggingface_hub`` writes it (``models--org--name/refs/main``,
``snapshots/<commit>/`` symlinks into ``blobs/``), from a generated tiny checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model_source import ModelSourceError, is_hub_id, resolve_model_path

from .support import make_engine

REPO = "tiny-org/tiny-vl"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(cache: Path, checkpoint: Path, repo: str = REPO, commit: str = COMMIT) -> Path:
    """The checkpoint as ``snapshot_download`` leaves it in ``cache``; returns the snapshot."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    blobs, snapshot = root / "blobs", root / "snapshots" / commit
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for src in sorted(checkpoint.iterdir()):
        data = src.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / src.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)  # the hub client writes no newline
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, checkpoint, monkeypatch) -> Path:
    cache = tmp_path / "hf-home" / "hub"
    write_hub_cache(cache, checkpoint)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(cache.parent))  # HF_HOME/hub, as the hub client does
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_only_org_name_that_is_not_a_local_directory_is_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "local" / "ckpt").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen2.5-VL-3B-Instruct")
    assert not is_hub_id("local/ckpt")  # exists: a local path wins
    assert not is_hub_id("/abs/path") and not is_hub_id("a/b/c") and not is_hub_id("plain")


def test_branch_and_commit_resolve_to_the_cached_snapshot(hub_cache):
    snapshot = hub_cache / "models--tiny-org--tiny-vl" / "snapshots" / COMMIT
    assert resolve_model_path(REPO) == snapshot
    assert resolve_model_path(REPO, revision=COMMIT) == snapshot
    assert resolve_model_path(REPO, revision="main") == snapshot


def test_hub_cache_env_wins_over_hf_home(hub_cache, tmp_path, monkeypatch):
    other = tmp_path / "other-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    with pytest.raises(ModelSourceError, match=re.escape(str(other))):
        resolve_model_path(REPO)


def test_an_uncached_revision_names_id_revision_and_cache(hub_cache):
    with pytest.raises(ModelSourceError) as info:
        resolve_model_path(REPO, revision="v2")
    message = str(info.value)
    assert REPO in message and "'v2'" in message and str(hub_cache) in message
    assert "HF_HUB_OFFLINE=1" in message and "local checkpoint directory" in message


def test_the_engine_loads_a_hub_id_and_serves_it_under_that_name(hub_cache):
    engine = make_engine(REPO, revision=COMMIT)
    try:
        assert engine.model_name == REPO
        assert engine.engine.model_dir.parent.name == "snapshots"
    finally:
        engine.shutdown()


def test_serve_with_an_uncached_id_exits_with_one_clear_line(tmp_path):
    cache = tmp_path / "empty-cache"
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "vision_serve.cli", "serve", "--model", "no-org/no-model",
         "--revision", "v1", "--device", "cpu", "--port", "0"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "'no-org/no-model'" in proc.stderr and "'v1'" in proc.stderr
    assert str(cache) in proc.stderr
    assert "Traceback" not in proc.stderr
