"""The sampler's top-k / top-p filtering against a direct reference: same support, same
probabilities (the nucleus search widens until it holds the mass), one draw per seed."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import _filtered, _sample_row, greedy_tokens
from engine.sampling_params import SamplingParams


def _reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Full-vocabulary probabilities after temperature, top-k and top-p, by sorting."""
    row = logits / temperature
    if 0 < top_k < row.shape[-1]:
        row = row.masked_fill(row < torch.topk(row, top_k).values[-1], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "spread"),
    [
        (1.0, 0, 0.9, 1.0),  # peaked: the nucleus is in the first guess
        (1.0, 0, 0.95, 0.01),  # nearly flat over 5,000 tokens: the search widens to all
        (0.7, 50, 0.8, 1.0),
        (1.3, 7, 1.0, 1.0),
    ],
)
def test_filtered_distribution_matches_a_full_sort(temperature, top_k, top_p, spread) -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5000, generator=gen) * 4 * spread
    want = _reference(logits, temperature, top_k, top_p)
    vocab = logits.shape[-1]
    probs, ids = _filtered(logits / temperature, top_k if 0 < top_k < vocab else vocab, top_p)
    got = torch.zeros(vocab).scatter_(0, ids, probs / probs.sum())
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_draws_follow_the_distribution_and_repeat_per_seed() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    params = SamplingParams(temperature=1.0, top_p=0.9)
    counts = torch.zeros(5)
    gen = torch.Generator().manual_seed(0)
    draws = [_sample_row(logits, params, gen) for _ in range(4000)]
    for d in draws:
        counts[d] += 1
    want = _reference(logits, 1.0, 0, 0.9)
    assert counts[want == 0].sum() == 0  # outside the nucleus: never
    torch.testing.assert_close(counts / counts.sum(), want, atol=0.03, rtol=0)
    again = torch.Generator().manual_seed(0)
    assert [_sample_row(logits, params, again) for _ in range(50)] == draws[:50]


def test_greedy_tokens_pick_as_torch_argmax_does() -> None:
    """The numpy fast path picks what ``torch.argmax`` picks: the first of tied maxima, a NaN
    over any number, an -inf row's first token; for all rows, a subset, and a strided view,
    under inference mode as the runner calls it."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 32000, generator=gen)
    logits[1, [17, 900, 31999]] = 50.0  # ties: the first wins
    logits[2, 4321] = float("nan")
    logits[3] = float("-inf")
    logits[4, 0] = float("nan")
    logits[4, 5] = float("nan")
    with torch.inference_mode():
        for rows in ([0, 1, 2, 3, 4, 5], [1, 3, 5], [4], [5, 0]):
            want = logits[rows].argmax(dim=-1).tolist()
            assert greedy_tokens(logits.clone(), rows) == want
        wide = torch.randn(3, 64000, generator=gen)
        view = wide[:, ::2]  # not contiguous
        assert greedy_tokens(view, [0, 1, 2]) == view.argmax(dim=-1).tolist()
        half = logits.bfloat16()  # not fp32: the torch path
        assert greedy_tokens(half, [0, 2]) == half[[0, 2]].argmax(dim=-1).tolist()
