"""One-line, key=value logs, so a grep for ``camera=front`` finds a camera's whole story."""

from __future__ import annotations

import logging
import sys
from typing import Any


def setup_logging(level: str = "INFO") -> None:
    """Configure the root logger once for a pipeline or describer process."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        force=True,
    )


def _fmt(value: Any) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    if not text or any(ch.isspace() or ch in '"=' for ch in text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def kv(event: str, **fields: Any) -> str:
    """``event=NAME k=v ...``: values with spaces are quoted, floats get 3 decimals."""
    return " ".join([f"event={event}", *(f"{k}={_fmt(v)}" for k, v in fields.items())])
