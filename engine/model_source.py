"""Where ``--model`` points: a local checkpoint directory, or a Hugging Face Hub id.

``--model Qwen/Qwen2.5-VL-3B-Instruct`` (not an existing directory, shaped ``org/name``) is
fetched with ``huggingface_hub.snapshot_download`` into the standard HF cache (``HF_HOME`` /
``HF_HUB_CACHE``), so a model downloaded by ``hf download``, transformers or vLLM is reused and
ours is reused by them. Only the files the engine loads are fetched. Offline (``HF_HUB_OFFLINE=1``
or no network) a cached snapshot is used; a missing one is a :class:`ModelSourceError` that says
what to do, because a model server usually starts unattended and its log is all anyone reads.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger("engine.model_source")

# What the engine reads: configs, tokenizer, processor, chat template, weights (+ index). Not
# *.bin / *.pt / *.gguf duplicates of the weights, which can be several times the model's size.
ALLOW_PATTERNS = ["*.json", "*.jinja", "*.txt", "*.safetensors"]
# ``org/name`` as the Hub spells repo ids (letters, digits, ``-_.``; no ``..`` or leading dot)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelSourceError(RuntimeError):
    """``--model`` names no loadable checkpoint; the message says why and what to do."""


def is_hub_id(model: str) -> bool:
    """``org/name`` that is not an existing local directory (a local one always wins)."""
    return not Path(model).expanduser().is_dir() and bool(_HUB_ID.match(model))


def hub_cache_dir() -> Path:
    """The HF hub cache, read from the environment now (``huggingface_hub.constants`` reads it
    once, at import, which is too early for a process that sets it later)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory to load ``model`` from, downloading a Hub id if needed."""
    if not is_hub_id(model):
        if revision:
            log.warning("--revision %s ignored: %s is a local path", revision, model)
        return Path(model).expanduser()
    return _snapshot(model, revision or "main")


def _snapshot(repo_id: str, revision: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    offline = hub_offline()
    log.info(
        "model_source repo=%s revision=%s cache=%s offline=%s", repo_id, revision, cache, offline
    )
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            allow_patterns=ALLOW_PATTERNS,
            token=os.environ.get("HF_TOKEN") or None,
            local_files_only=offline,
        )
    except (GatedRepoError, RepositoryNotFoundError) as exc:
        raise ModelSourceError(
            f"model {repo_id!r} (revision {revision!r}) is not on the Hugging Face Hub or needs "
            f"access: set HF_TOKEN to a token that can read it ({type(exc).__name__})"
        ) from None
    except RevisionNotFoundError:
        raise ModelSourceError(
            f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub"
        ) from None
    except HFValidationError as exc:
        raise ModelSourceError(f"--model {repo_id!r} is not a valid Hub id: {exc}") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        # LocalEntryNotFoundError and IncompleteSnapshotError land here: not (fully) cached
        # and the Hub unreachable or disabled
        raise _not_cached(repo_id, revision, cache, offline, exc) from None
    return _check_snapshot(Path(path), repo_id, revision)


def _not_cached(
    repo_id: str, revision: str, cache: Path, offline: bool, exc: Exception
) -> ModelSourceError:
    why = "HF_HUB_OFFLINE=1" if offline else f"the Hub could not be reached ({type(exc).__name__})"
    return ModelSourceError(
        f"model {repo_id!r} (revision {revision!r}) is not in the Hugging Face cache at "
        f"{cache} and cannot be downloaded: {why}. Download it on a machine with network access "
        f"(`hf download {repo_id} --revision {revision}` with HF_HUB_CACHE={cache}, or copy that "
        f"cache here), or pass a local checkpoint directory as --model."
    )


def _check_snapshot(path: Path, repo_id: str, revision: str) -> Path:
    """A snapshot without config or weights (a filtered or interrupted download) would fail
    later with a less helpful error."""
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ModelSourceError(
            f"the cached snapshot of {repo_id!r} (revision {revision!r}) at {path} has no "
            "config.json or no *.safetensors weights; download it again with network access"
        )
    log.info("model_source repo=%s revision=%s path=%s", repo_id, revision, path)
    return path


def model_display_name(model: str) -> str:
    """The name reported for ``model``: a Hub id as given (what vLLM serves it as, and what
    clients send), a local checkpoint by its directory name."""
    return model if is_hub_id(model) else Path(model).expanduser().name
