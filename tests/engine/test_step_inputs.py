"""The decode step's cheap input paths give exactly what the general ones do: rotary angles
looked up by text position, positions of generated tokens, padded block tables."""

from __future__ import annotations

import pytest
import torch

from engine.layers.attention import padded_block_tables
from engine.layers.rotary import MRotaryEmbedding
from engine.request import ProcessedPrompt, Request
from engine.sampling_params import SamplingParams


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, section", [(64, [8, 12, 12]), (128, [16, 24, 24])])
def test_rotary_lookup_equals_computing(dtype, head_dim, section) -> None:
    rotary = MRotaryEmbedding(head_dim, 1e6, section)
    # past the first table (1,024 rows) and a grown one, in any order, with repeats
    positions = [0, 5, 1023, 1024, 77, 5, 3000, 40_000, 2]
    got_cos, got_sin = rotary.cos_sin_at(positions, dtype)
    ids = torch.tensor(positions, dtype=torch.long)
    want_cos, want_sin = rotary.cos_sin(ids.expand(3, -1), dtype)
    assert got_cos.dtype == dtype and got_cos.shape == (len(positions), head_dim)
    assert torch.equal(got_cos, want_cos) and torch.equal(got_sin, want_sin)
    # a negative position (a prompt whose images pulled positions below the token index) is
    # computed, not looked up
    neg_cos, neg_sin = rotary.cos_sin_at([-3, 4], dtype)
    want = rotary.cos_sin(torch.tensor([-3, 4]).expand(3, -1), dtype)
    assert torch.equal(neg_cos, want[0]) and torch.equal(neg_sin, want[1])


def _request(prompt_len: int, delta: int) -> Request:
    positions = torch.stack(
        [torch.arange(prompt_len), torch.arange(prompt_len) % 4, torch.arange(prompt_len) // 4]
    )
    prompt = ProcessedPrompt(None, list(range(1, prompt_len + 1)), positions, delta)
    return Request("r", prompt, SamplingParams(max_tokens=8), eos_token_ids={0})


def test_generated_token_positions() -> None:
    req = _request(10, -3)
    req.output_token_ids = [5, 6, 7]
    assert torch.equal(req.positions(11, 13), torch.tensor([[8, 9]] * 3))
    assert torch.equal(req.positions(8, 12)[:, :2], req.prompt.positions[:, 8:10])
    assert torch.equal(req.positions(8, 12)[:, 2:], torch.tensor([[7, 8]] * 3))
    assert req.text_position(12) == 9
    assert req.text_position(9) is None  # a prompt token: its axes may differ


def test_padded_block_tables() -> None:
    out = padded_block_tables([[3, 1], [7], [2, 9, 4]])
    assert out.dtype == torch.long
    assert out.tolist() == [[3, 1, 0], [7, 0, 0], [2, 9, 4]]
