"""CPU linear layers: oneDNN-prepacked weights, or bf16 weights computed in fp32.

``F.linear`` re-lays-out a bf16 weight on every call; packing it once into oneDNN's blocked
format makes decode-size matmuls (a handful of rows) 2-3x faster and prefill-size ones ~10%
faster on AVX512-BF16/AMX CPUs (measured in ``benchmarks/offline_throughput.py``). The math is
the same kernel family, so outputs match ``F.linear``.

CPUs without bf16 arithmetic (AVX-512 without BF16, AVX2) run oneDNN's bf16 GEMM emulated, at
a fifth of the fp32 rate (62 against 305-340 GFLOP/s on a 2-core Ice Lake). There a bf16
weight stays bf16 in memory (half the bytes a decode step streams) and prefill-sized products
widen it to fp32 per call: the widening is one pass over the weight, ~1 % of a 1,000-row
product, and the product runs at the fp32 rate (302 against 64 GFLOP/s at 1,245 rows).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("engine.layers")


class PackedLinear(nn.Module):
    """``rows_hint``: the rows a call usually carries, which oneDNN lays the weight out for.
    At 1 (decode-sized calls) an fp32 weight stays row-major (AVX2 and AVX-512 alike), and
    every many-row call then re-blocks all of it: an MLP of the vision tower's work items (fp32
    on AVX2 CPUs) took 23 % longer so, 15 % after a 160 MB stream had evicted its weights
    (2-core Zen 4 planned as AVX2, 67 rows through 384x1536 and back, in turns)."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rows_hint = rows_hint
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.dtype = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"rows_hint={self.rows_hint}"
        )


class UpcastLinear(nn.Module):
    """A bf16 linear on a CPU without bf16 arithmetic: fp32 products from ``MIN_ROWS`` rows;
    below that engine.kernels' GEMV where it is built (``kernels``), else ``F.linear``."""

    # measured at 4096x1024 on a 2-core Ice Lake: at 16 rows widening already wins (75 against
    # 54 GFLOP/s packed bf16), at 4 rows not yet (32 against 37); the kernels' GEMV beats both
    # below 16 rows (4096x768, 4 rows: 0.11 ms against 0.76 emulated bf16, 0.76 widened)
    MIN_ROWS = 16

    def __init__(self, linear: nn.Linear, kernels=None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.kernels = kernels

    def widens(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is enough rows for the fp32 product (see ``forward_fp32``)."""
        return x.numel() >= self.MIN_ROWS * self.in_features

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """The widened product, left in fp32 for a caller that feeds it to another one
        (MLP): rounding a [T, 2 x intermediate] activation to bf16 and widening it back cost
        more than the activation function itself."""
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(x.float(), self.weight.float(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.widens(x):
            if self.kernels is not None and x.dtype == torch.bfloat16 and x.numel() > 0:
                flat = x.reshape(-1, self.in_features)
                y = self.kernels.small_matmul(flat, self.weight)
                if self.bias is not None:
                    y = y + self.bias
                return y.view(*x.shape[:-1], self.out_features)
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return self.forward_fp32(x).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


CPU_LINEAR_TYPES = (nn.Linear, PackedLinear, UpcastLinear)


def cpu_packing_available(dtype: torch.dtype) -> bool:
    """Probe once: the op exists, runs, and agrees with ``F.linear``."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        lin = nn.Linear(32, 48, bias=True).to(dtype)
        x = torch.randn(3, 32, dtype=dtype)
        got = PackedLinear(lin)(x)
        want = torch.nn.functional.linear(x, lin.weight, lin.bias)
        return torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    except (RuntimeError, AttributeError) as exc:
        log.info("mkldnn weight packing unavailable: %s", exc)
        return False


def pack_linears(
    module: nn.Module,
    skip_prefixes: tuple[str, ...] = (),
    upcast_bf16: bool | None = None,
    rows_hint: int = 1,
) -> int:
    """Replace every ``nn.Linear`` under ``module`` (except under ``skip_prefixes``) in place:
    packed for oneDNN (for calls of about ``rows_hint`` rows, see :class:`PackedLinear`), or,
    bf16 on a CPU without bf16 arithmetic (``upcast_bf16``: the platform plan's call; None
    probes the CPU), an :class:`UpcastLinear`."""
    from engine.device import cpu_has_fast_bf16

    targets = [
        (name, child)
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear) and not name.startswith(skip_prefixes)
    ]
    emulated = not cpu_has_fast_bf16() if upcast_bf16 is None else upcast_bf16
    kernels = None
    if emulated:
        from engine.kernels import load_cpu_decode

        kernels = load_cpu_decode()
    for name, child in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        upcast = emulated and child.weight.dtype == torch.bfloat16
        replacement = UpcastLinear(child, kernels) if upcast else PackedLinear(child, rows_hint)
        setattr(parent, attr, replacement)
    return len(targets)
