"""Machine-dependent defaults: which dtype ``auto`` picks and how finely image encoding is split."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import engine.device
from engine.config import EngineArgs
from engine.device import resolve_dtype
from engine.kernels import load_cpu_decode
from engine.llm_engine import LLMEngine

CPU = torch.device("cpu")


def test_auto_dtype_is_bf16_where_the_cpu_runs_it_fast_or_the_kernels_build() -> None:
    fast = engine.device.cpu_has_fast_bf16() or load_cpu_decode() is not None
    assert resolve_dtype("auto", CPU) == (torch.bfloat16 if fast else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", CPU) == torch.float32


def test_auto_dtype_without_bf16_arithmetic_or_kernels_is_fp32(monkeypatch) -> None:
    monkeypatch.setattr(engine.device, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", CPU, cpu_kernels=False) == torch.float32


def _rows(device: str, dtype: torch.dtype, requested: int | None = None) -> int | None:
    engine_like = SimpleNamespace(device=torch.device(device), dtype=dtype)
    args = EngineArgs(model="unused", encoder_rows_per_item=requested)
    return LLMEngine._encoder_rows_per_item(engine_like, args)


def test_encoder_items_follow_the_device(monkeypatch) -> None:
    assert _rows("cuda", torch.bfloat16) is None  # whole stages
    assert _rows("cpu", torch.float32) == 256
    monkeypatch.setattr("engine.llm_engine.cpu_has_fast_bf16", lambda: True)
    assert _rows("cpu", torch.bfloat16) == 64
    monkeypatch.setattr("engine.llm_engine.cpu_has_fast_bf16", lambda: False)
    assert _rows("cpu", torch.bfloat16) == 256
    assert _rows("cpu", torch.bfloat16, requested=32) == 32
    assert _rows("cpu", torch.bfloat16, requested=0) is None
