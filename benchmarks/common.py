"""Shared benchmark plumbing: the bench checkpoint, synthetic camera frames, result files."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
# VISION_SERVE_RESULTS redirects output (the smoke tests write into a temporary directory)
RESULTS = Path(os.environ.get("VISION_SERVE_RESULTS", ROOT / "results"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench_checkpoint(family: str = "qwen2_vl", path: str | None = None) -> Path:
    """The ``bench`` preset checkpoint, generated once into ./checkpoints (not committed)."""
    if path:
        return Path(path)
    out = ROOT / "checkpoints" / f"bench-{family}"
    if not (out / "config.json").exists():
        from engine.checkpoints import make_model

        log(f"generating bench checkpoint into {out} (one-off, ~1 min)")
        make_model(family, "bench", out, seed=0)
    return out


def camera_frame(width: int = 640, height: int = 480, seed: int = 0) -> Image.Image:
    """A synthetic frame: smooth gradients plus noise, so JPEG/processing cost is realistic."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    noisy = base + rng.normal(0, 20, base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def save_json(name: str, data: dict) -> Path:
    """Writes ``data`` as JSON: a bare name goes under results/, a path (``--out dir/x.json``)
    where it says -- a benchmark that ran for minutes must not die on where to save."""
    path = Path(name) if Path(name).parent != Path(".") else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=float))
    log(f"saved {path}")
    return path


def checkpoint_args(ap, dtype: str = "bfloat16") -> None:
    """The flags every engine benchmark shares: which checkpoint, which dtype, which decode."""
    ap.add_argument("--model", help="checkpoint dir (default: the family's bench preset)")
    ap.add_argument("--family", default="qwen2_vl")
    ap.add_argument("--dtype", default=dtype)
    ap.add_argument(
        "--cpu-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="engine/kernels: native decode step and attention (off: eager PyTorch only)",
    )


def setup_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
