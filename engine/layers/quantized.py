"""Weight-only int8 linears (``--quantization int8``): per-output-channel symmetric scales.

Why weight-only int8: a CPU decode step is a few rows against every weight, so it costs the
bytes it streams. int8 weights are a quarter of fp32's and half of bf16's, and on CPUs
without bf16 arithmetic (AVX2, plain AVX-512) they also avoid oneDNN's slow emulated bf16
path. Activations stay in floating point: each weight byte is widened to fp32 in registers
(``engine/kernels/int8_linear.cpp``), so the only error is the weight rounding, at most half
a step of ``max|w_row| / 127`` per weight.

Decode-sized products (up to ``GEMV_MAX_ROWS`` rows) run the kernel; prefill-sized ones are
compute-bound, so the weight is dequantized once per call into a temporary fp32 buffer and the
fp32 GEMM runs (one pass over the weight, a few % of a prefill chunk's product; keeping fp32
copies would give back the memory int8 saves). Where bf16 arithmetic is native and
activations are bf16, prefill-sized products instead run bf16 x int8-as-bf16 (every int8 value
is exact in bf16) and scale the fp32 product: 4x faster than the fp32 GEMM on a Zen 5 (256 rows
of a 2048 x 768 matrix: 1.9 against 7.6 ms), at one more bf16 rounding of the product (relative
error 2.3e-3 against 1.7e-3 for the fp32 product rounded to bf16). Without the kernel (no AVX2,
no compiler) every call dequantizes with PyTorch ops: same numbers, slower.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

log = logging.getLogger("engine.layers")

QUANTIZATION_METHODS = ("int8",)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` with ``weight ~= q * scales[:, None]``: symmetric, one scale per output
    channel (row), rounded to nearest; an all-zero row gets scale 1 (q = 0 either way)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


class Int8Linear(nn.Module):
    """An ``nn.Linear`` whose weight is held as int8 plus fp32 per-row scales."""

    GEMV_MAX_ROWS = 16

    def __init__(
        self, linear: nn.Linear, kernels: ModuleType | None = None, bf16_products: bool = False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.qweight, self.scales = quantize_int8(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.kernels = kernels
        self.bf16_products = bf16_products  # bf16 arithmetic is native here (module doc)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight this layer computes with, in a new buffer."""
        out = torch.empty(self.qweight.shape, dtype=torch.float32)
        if self.kernels is not None:
            self.kernels.dequantize_into(self.qweight, self.scales, out)
        else:
            torch.mul(self.qweight, self.scales[:, None], out=out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.kernels is not None and 0 < flat.shape[0] <= self.GEMV_MAX_ROWS:
            y = self.kernels.int8_matmul(flat.float(), self.qweight, self.scales, self.bias)
        elif self.bf16_products and flat.dtype == torch.bfloat16:
            y = torch.nn.functional.linear(flat, self.qweight.to(torch.bfloat16)).float()
            y.mul_(self.scales)
            if self.bias is not None:
                y.add_(self.bias)
        else:
            y = torch.nn.functional.linear(flat.float(), self.dequantize(), self.bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def quantize_linears(
    module: nn.Module, skip_prefixes: tuple[str, ...] = (), bf16_products: bool = False
) -> int:
    """Replace every ``nn.Linear`` under ``module`` (except under ``skip_prefixes``) by an
    :class:`Int8Linear`, in place. Returns how many were replaced."""
    from engine.kernels import load_int8_linear

    kernels = load_int8_linear()
    targets = [
        (name, child)
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear) and not name.startswith(skip_prefixes)
    ]
    for name, child in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, Int8Linear(child, kernels, bf16_products))
    if kernels is None:
        log.warning("int8 linears run without the AVX2 kernel: every product dequantizes")
    return len(targets)
