"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Order of work per row, as vLLM's V1 sampler does it: logprobs are taken from the model's raw
logits (what the model believes, not what the request's processing made of it); then banned
tokens (min_tokens), ``logit_bias`` and the penalties are applied; then greedy picks the best
token or temperature, min-p, top-k and top-p shape the distribution it is drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: the sampled token's logprob and its top alternatives, or None when not asked
    logprobs: list[TokenLogprob | None] = field(default_factory=list)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[list[int]],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
) -> SamplerOutput:
    """logits: [B, V] float32, modified in place. ``banned[i]``: token ids row ``i`` may not
    pick (min_tokens). ``histories[i]``: row ``i``'s (prompt, generated) token ids, needed
    only by rows with penalties."""
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits[logprob_rows].float(), dim=-1) if logprob_rows else None
    for i, ids in enumerate(banned):
        if ids:
            logits[i, ids] = float("-inf")
    for i, p in enumerate(params):
        if p.logit_bias:
            apply_logit_bias(logits[i], p.logit_bias)
        if p.has_penalties:
            if histories is None:
                raise ValueError("penalties need the rows' token histories")
            prompt_ids, output_ids = histories[i]
            apply_penalties(logits[i], p, prompt_ids, output_ids)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    result = [0] * len(params)
    if greedy_rows:
        picks = greedy_tokens(logits, greedy_rows)
        for row, tok in zip(greedy_rows, picks, strict=True):
            result[row] = tok
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        # on the host, in one copy: the requests' generators are CPU generators
        rows = logits[sampled_rows].float().cpu()
        for row, i in zip(rows, sampled_rows, strict=True):
            result[i] = _sample_row(row, params[i], generators[i])
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    if raw_logprobs is not None:
        for row, i in zip(raw_logprobs.cpu(), logprob_rows, strict=True):
            logprobs[i] = token_logprob(row, result[i], params[i].logprobs or 0)
    return SamplerOutput(result, logprobs)


def greedy_tokens(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """The best token of each of ``rows`` (first one on ties; a NaN counts as the best, as
    ``torch.argmax`` has it). On the host through numpy: torch's CPU argmax walks a 32k
    vocabulary element by element (~75 us a row here, 0.5 ms at batch 16), numpy's is
    vectorised (~5 us a row) -- on a 13 ms batch-1 decode step the difference is measurable."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        host = logits.numpy()
        best = host.argmax(axis=-1) if len(rows) == host.shape[0] else host[rows].argmax(axis=-1)
        return best.tolist()
    return logits[rows].argmax(dim=-1).tolist()


def apply_logit_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
    ids = torch.tensor(list(bias), dtype=torch.long, device=row.device)
    row.index_add_(0, ids, torch.tensor(list(bias.values()), dtype=row.dtype, device=row.device))


def apply_penalties(
    row: torch.Tensor,
    p: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
) -> None:
    """OpenAI's presence/frequency penalties over the generated tokens (subtracted from the
    logit), and the multiplicative repetition penalty over prompt and generated tokens
    (a positive logit divided by it, a negative one multiplied), as vLLM applies them."""
    device = row.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.long, device=device)
        seen = seen.unique()
        if seen.numel():
            values = row[seen]
            row[seen] = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(list(output_ids), dtype=torch.long, device=device).unique(
            return_counts=True
        )
        penalty = counts.to(row.dtype) * p.frequency_penalty + p.presence_penalty
        row.index_add_(0, ids, -penalty)


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The sampled token's logprob and rank (1 = the model's most likely token), and the
    ``top`` most likely tokens, best first."""
    chosen = float(logprobs[token])
    rank = int((logprobs > chosen).sum()) + 1
    alternatives: list[tuple[int, float]] = []
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        alternatives = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, chosen, rank, alternatives)


# top-p without top-k looks for the nucleus among this many best tokens first, widening 8x
# while their mass is short of top_p: sorting the whole vocabulary per row per step had cost
# 2 ms a row (32k vocabulary), more than the batch-16 decode step it followed
_NUCLEUS_FIRST_GUESS = 256


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    logits = row.float() / p.temperature
    if p.min_p > 0.0:
        # vLLM's min-p, after temperature: p(token) < min_p * p(best) is dropped, i.e. a
        # logit below the best one by more than -log(min_p)
        cutoff = logits.max() + torch.log(torch.tensor(p.min_p))
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
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
