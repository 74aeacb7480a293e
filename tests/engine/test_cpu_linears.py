"""The CPU linear replacements (``engine.layers.linear``) compute what ``F.linear`` does.

Which one a model gets depends on the machine (oneDNN-packed, or bf16 widened to fp32 where the
CPU has no bf16 arithmetic), so both are tested directly, on whatever CPU runs the tests.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.kernels import load_cpu_decode
from engine.layers.linear import PackedLinear, UpcastLinear, cpu_packing_available, pack_linears


def _linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).bfloat16()


@pytest.mark.parametrize("rows", [1, 3, UpcastLinear.MIN_ROWS - 1, UpcastLinear.MIN_ROWS, 70])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("with_kernels", [False, True])
def test_upcast_linear_matches_fp32_product(rows: int, bias: bool, with_kernels: bool) -> None:
    kernels = load_cpu_decode() if with_kernels else None
    if with_kernels and kernels is None:
        pytest.skip("engine.kernels not built on this CPU")
    lin = _linear(96, 80, bias, seed=rows)
    x = torch.randn(rows, 96).bfloat16()
    want = nn.functional.linear(
        x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float()
    )
    got = UpcastLinear(lin, kernels)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 80)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)  # one bf16 rounding


@pytest.mark.parametrize("rows", [3, 20])  # 6 rows: the GEMV (or F.linear); 40: widened
def test_upcast_linear_keeps_leading_dimensions(rows: int) -> None:
    lin = _linear(32, 16, True, seed=0)
    x = torch.randn(2, rows, 32).bfloat16()
    got = UpcastLinear(lin, load_cpu_decode())(x)
    assert got.shape == (2, rows, 16)
    torch.testing.assert_close(
        got, nn.functional.linear(x, lin.weight, lin.bias), rtol=2e-2, atol=2e-2
    )


@pytest.mark.skipif(not cpu_packing_available(torch.bfloat16), reason="no oneDNN bf16 packing")
def test_packed_linear_matches_f_linear() -> None:
    lin = _linear(64, 48, True, seed=1)
    x = torch.randn(5, 64).bfloat16()
    torch.testing.assert_close(
        PackedLinear(lin)(x).float(),
        nn.functional.linear(x, lin.weight, lin.bias).float(),
        rtol=1e-2,
        atol=1e-2,
    )


def test_pack_linears_picks_by_machine_and_dtype(monkeypatch) -> None:
    import engine.device

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).bfloat16()
    monkeypatch.setattr(engine.device, "cpu_has_fast_bf16", lambda: False)
    assert pack_linears(model) == 2
    assert all(isinstance(model[i], UpcastLinear) for i in (0, 2))
    fp32 = nn.Sequential(nn.Linear(8, 8))
    if cpu_packing_available(torch.float32):
        pack_linears(fp32)  # fp32 weights are never "upcast": packed
        assert isinstance(fp32[0], PackedLinear)
