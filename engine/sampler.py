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
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        # on the host, in one copy: the requests' generators are CPU generators
        rows = logits[sampled_rows].float().cpu()
        for row, i in zip(rows, sampled_rows, strict=True):
            result[i] = _sample_row(row, params[i], generators[i])
    return result


# top-p without top-k looks for the nucleus among this many best tokens first, widening 8x
# while their mass is short of top_p: sorting the whole vocabulary per row per step had cost
# 2 ms a row (32k vocabulary), more than the batch-16 decode step it followed
_NUCLEUS_FIRST_GUESS = 256


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    logits = row.float() / p.temperature
    vocab = logits.shape[-1]
    top_k = p.top_k if 0 < p.top_k < vocab else vocab
    ids: torch.Tensor | None = None
    if top_k < vocab or p.top_p < 1.0:
        probs, ids = _filtered(logits, top_k, p.top_p)
    else:
        probs = torch.softmax(logits, dim=-1)
    # inverse CDF with one uniform draw from the request's generator: reproducible per seed
    cdf = probs.cumsum(-1)
    u = torch.rand((), generator=gen) * cdf[-1]
    index = min(int(torch.searchsorted(cdf, u, right=True)), cdf.shape[-1] - 1)
    return index if ids is None else int(ids[index])


def _filtered(logits: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities (unnormalised) and ids of the tokens top-k and top-p leave, best first."""
    probs, ids = _best_candidates(logits, top_k, top_p)
    if top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = int(((probs.cumsum(-1) - probs) <= top_p).sum())
        probs, ids = probs[:keep], ids[:keep]
    return probs, ids


def _best_candidates(
    logits: torch.Tensor, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities and ids of the best tokens, best first: the top-k renormalised, or (top-p
    alone) a prefix of the full distribution that holds more than ``top_p`` of its mass."""
    vocab = logits.shape[-1]
    if top_k < vocab:
        values, ids = torch.topk(logits, top_k)
        return torch.softmax(values, dim=-1), ids
    log_total = torch.logsumexp(logits, dim=-1)
    n = min(vocab, _NUCLEUS_FIRST_GUESS)
    while True:
        values, ids = torch.topk(logits, n)
        probs = torch.exp(values - log_total)
        if n == vocab or float(probs.sum()) > top_p:
            return probs, ids
        n = min(vocab, n * 8)
