"""Multimodal rotary embedding (M-RoPE, Qwen2-VL).

Each token carries three position ids (temporal, height, width). The rotary frequency bands are
split by ``mrope_section``: band group ``i`` takes its angle from position axis ``i % 3``. Text
tokens have all three ids equal, so M-RoPE reduces to ordinary 1-D RoPE for them.
"""

from __future__ import annotations

import torch


class MRotaryEmbedding:
    def __init__(self, head_dim: int, theta: float, mrope_section: list[int]) -> None:
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {mrope_section} must sum to head_dim/2 = {head_dim // 2}"
            )
        # explicit device: models are built under a meta-device context, these must stay real
        steps = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu")
        self.inv_freq = 1.0 / (theta ** (steps / head_dim))
        # axis (0=t, 1=h, 2=w) that feeds each of the head_dim/2 frequency bands
        axis = [i % 3 for i, n in enumerate(mrope_section) for _ in range(n)]
        self.band_axis = torch.tensor(axis, dtype=torch.long, device="cpu")
        # cos/sin of text positions 0 .. n - 1 per dtype, grown on demand (see cos_sin_at)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] int64 -> cos, sin: [T, head_dim] in ``dtype``."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            self.band_axis = self.band_axis.to(positions.device)
        freqs = positions.float()[..., None] * self.inv_freq  # [3, T, D/2]
        band_axis = self.band_axis
        # pick, per band, the angle from its axis
        freqs = freqs.gather(0, band_axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)).squeeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin_at(
        self, positions: list[int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] of text positions (all three M-RoPE axes equal: every
        generated token), looked up in a table. Why: a decode step computes the rotary angles
        of a handful of rows, and the ten small tensor ops of :meth:`cos_sin` cost ~0.2 ms a
        step on a CPU, over 1 % of a batch-1 step. The table is :meth:`cos_sin` of positions
        0 .. n - 1 itself, so a lookup returns exactly what computing would."""
        top = max(positions) + 1
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < top or min(positions) < 0:
            if min(positions) < 0:  # not a table row: compute
                ids = torch.tensor(positions, dtype=torch.long, device=self.inv_freq.device)
                return self.cos_sin(ids.expand(3, -1), dtype)
            size = max(1024, 1 << (top - 1).bit_length())
            grid = torch.arange(size, dtype=torch.long, device=self.inv_freq.device)
            table = self.cos_sin(grid.expand(3, -1), dtype)
            self._tables[dtype] = table
        index = torch.tensor(positions, dtype=torch.long, device=table[0].device)
        return table[0].index_select(0, index), table[1].index_select(0, index)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
