"""Sampling defaults from a checkpoint's ``generation_config.json``, as vLLM applies them.

Model authors publish the sampling they tuned for (Qwen2.5-VL: ``repetition_penalty`` 1.05,
low ``temperature``/``top_p``/``top_k``). vLLM (``--generation-config auto``, its default) uses
those values for the fields a request leaves out, so a client that sends only ``messages`` gets
the author's sampling; ``--generation-config vllm`` ignores the file; a folder path reads the
file from there instead. We do the same, so answers match a vLLM server's on one checkpoint.

The file is read as written: ``do_sample`` is ignored (vLLM ignores it too), and keys absent
from the file never override anything.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("engine.generation_config")

# generation_config.json key -> sampling field it sets the default of (vLLM's list)
SAMPLING_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
FILENAME = "generation_config.json"


class GenerationConfigError(ValueError):
    """``--generation-config`` names no readable generation config."""


def load_sampling_defaults(source: str, model_dir: str | Path) -> dict[str, Any]:
    """Sampling defaults by ``--generation-config``: ``auto`` reads ``model_dir``'s file,
    ``vllm`` gives none, anything else is a folder that must hold the file."""
    if source == "vllm":
        return {}
    if source == "auto":
        path = Path(model_dir) / FILENAME
        if not path.is_file():
            return {}
    else:
        path = Path(source).expanduser() / FILENAME
        if not path.is_file():
            raise GenerationConfigError(
                f"--generation-config {source!r}: no {FILENAME} in that folder "
                "(use 'auto' for the checkpoint's own, or 'vllm' for none)"
            )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path} is not a JSON object")
    defaults = {
        field: data[key] for key, field in SAMPLING_KEYS.items() if data.get(key) is not None
    }
    if defaults:
        log.warning(
            "Default sampling parameters have been overridden by the model's Hugging Face "
            "generation config recommended from the model creator (%s): %s. If this is not "
            "intended, relaunch with `--generation-config vllm`.",
            path,
            json.dumps(defaults, sort_keys=True),
        )
    return defaults
