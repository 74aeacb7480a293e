"""The private torch APIs the engine relies on, pinned: a torch upgrade that renames one or
changes what it does fails here, with a message naming it, instead of turning the engine
quietly slower (each call site falls back when the op is missing or raises).

No public API does what these do (checked against torch 2.14):
- ``torch.cpu._is_avx2_supported`` / ``_is_avx512_supported`` / ``_is_avx512_bf16_supported`` /
  ``_is_vnni_supported`` (AVX512-VNNI) /
  ``_is_amx_tile_supported`` (engine/kernels/__init__.py, engine/device.py): the public
  ``torch.backends.cpu.get_cpu_capability()`` names the AVX2/AVX512 level only, says nothing
  of AVX512-BF16 or AMX, and follows the ``ATEN_CPU_CAPABILITY`` override rather than the CPU.
- ``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise`` (engine/layers/linear.py,
  and called boxed from engine/kernels/cpu_decode.cpp): oneDNN weight prepacking; the public
  ``torch.utils.mkldnn.to_mkldnn`` converts every activation to and from the mkldnn layout.
- ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (engine/layers/attention.py):
  CPU flash attention that also returns the log-sum-exp, which merges a chunk's cached prefix
  and its causal part; ``F.scaled_dot_product_attention`` returns no log-sum-exp.
``torch._C._GLIBCXX_USE_CXX11_ABI`` was replaced by the public ``torch.compiled_with_cxx11_abi``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import PackedLinear, cpu_packing_available


def _private(owner: object, name: str, where: str) -> object:
    op = getattr(owner, name, None)
    assert op is not None, f"{name} is gone in torch {torch.__version__}: {where} needs it"
    return op


def _cpuinfo_flags() -> set[str]:
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        pytest.skip("no /proc/cpuinfo to compare the probes with")
    for line in path.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("/proc/cpuinfo lists no flags")


# probe -> the /proc/cpuinfo flags it must agree with (what the kernels' -m flags assume)
PROBES = {
    "_is_avx2_supported": {"avx2", "fma"},
    "_is_avx512_supported": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "_is_avx512_bf16_supported": {"avx512_bf16"},
    "_is_vnni_supported": {"avx512_vnni"},
    "_is_amx_tile_supported": {"amx_tile"},
}


@pytest.mark.parametrize("name", sorted(PROBES))
def test_torch_cpu_probe_exists_and_agrees_with_the_cpu(name: str) -> None:
    probe = _private(torch.cpu, name, "engine.kernels.cpu_variant / engine.device")
    got = probe()
    assert isinstance(got, bool), f"torch.cpu.{name}() returned {got!r}, not a bool"
    want = PROBES[name] <= _cpuinfo_flags()
    assert got == want, f"torch.cpu.{name}() is {got}, /proc/cpuinfo says {want}"


def test_cpu_probes_agree_with_the_public_capability() -> None:
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("ATEN_CPU_CAPABILITY overrides the public capability")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        assert torch.cpu._is_avx512_supported(), capability
    if capability in ("AVX2", "AVX512"):
        assert torch.cpu._is_avx2_supported(), capability


# The C++ decode step calls mkldnn::_linear_pointwise boxed, pushing exactly these six
# arguments (engine/kernels/cpu_decode.cpp, onednn_linear): a new argument breaks it there.
LINEAR_POINTWISE = (
    "mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, "
    "str? algorithm) -> Tensor Y"
)
REORDER_LINEAR_WEIGHT = (
    "mkldnn::_reorder_linear_weight(Tensor self, int? batch_size=None) -> Tensor Y"
)
FLASH_CPU = (
    "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, "
    "float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) "
    "-> (Tensor output, Tensor logsumexp)"
)


@pytest.mark.parametrize(
    ("namespace", "name", "schema", "where"),
    [
        ("mkldnn", "_linear_pointwise", LINEAR_POINTWISE, "PackedLinear, cpu_decode.cpp"),
        ("mkldnn", "_reorder_linear_weight", REORDER_LINEAR_WEIGHT, "PackedLinear"),
        ("aten", "_scaled_dot_product_flash_attention_for_cpu", FLASH_CPU, "attention.py"),
    ],
)
def test_private_op_schema_is_the_one_we_call(
    namespace: str, name: str, schema: str, where: str
) -> None:
    if namespace == "mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN: PackedLinear is never used")
    op = _private(getattr(torch.ops, namespace), name, where)
    got = str(op.default._schema)
    assert got == schema, f"torch.ops.{namespace}.{name} changed ({where} calls it):\n{got}"


@pytest.mark.parametrize("rows_hint", [1, 64])  # decode-sized, and the vision tower's items
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 64), (67, 64)])
def test_mkldnn_packed_linear_equals_f_linear(
    dtype: torch.dtype, bias: bool, shape: tuple[int, ...], rows_hint: int
) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias).to(dtype)
    try:
        packed = PackedLinear(lin, rows_hint)
    except RuntimeError as exc:
        # torch 2.14 on AVX2 (or oneDNN capped there: ONEDNN_MAX_CPU_ISA, README "Kernels"):
        # "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq";
        # the engine then keeps bf16 linears unpacked (UpcastLinear)
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
        below_avx512 = not torch.cpu._is_avx512_supported() or (
            cap != "" and not cap.startswith("AVX512")
        )
        assert dtype == torch.bfloat16 and below_avx512, (
            f"torch.ops.mkldnn._reorder_linear_weight fails for {dtype}: {exc}"
        )
        assert not cpu_packing_available(dtype)
        return
    x = torch.randn(*shape, generator=gen).to(dtype)
    got = packed(x)
    want = F.linear(x, lin.weight, lin.bias)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert cpu_packing_available(dtype), "mkldnn packing works, yet the probe says no"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_for_cpu_returns_output_and_natural_log_sum_exp(
    dtype: torch.dtype, causal: bool
) -> None:
    """What ``_prefix_plus_causal`` relies on: (out [B, H, L, D] in the input dtype, lse
    [B, H, L] in fp32, natural log of the scaled scores' sum of exponentials), ``scale`` as a
    keyword, and ``is_causal`` masking key j > query i (top left, for L == S)."""
    op = _private(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", "engine.layers.attention"
    )
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 3, 7, 16, generator=gen).to(dtype) for _ in range(3))
    scale = 0.37
    out, lse = op(q, k, v, 0.0, causal, scale=scale)
    assert out.shape == (1, 3, 7, 16) and out.dtype == dtype
    assert lse.shape == (1, 3, 7) and lse.dtype == torch.float32
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-4, atol=1e-4)
    want = torch.softmax(scores, dim=-1) @ v.float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
