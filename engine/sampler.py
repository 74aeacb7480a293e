"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[list[int]],
) -> list[int]:
    """logits: [B, V] float32. ``banned[i]``: token ids row ``i`` may not pick (min_tokens)."""
    for i, ids in enumerate(banned):
        if ids:
            logits[i, ids] = float("-inf")
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    result = [0] * len(params)
    if greedy_rows:
        picks = logits[greedy_rows].argmax(dim=-1).tolist()
        for row, tok in zip(greedy_rows, picks, strict=True):
            result[row] = tok
    for i, p in enumerate(params):
        if p.greedy:
            continue
        result[i] = _sample_row(logits[i], p, generators[i])
    return result


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = cumulative - sorted_probs > p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
