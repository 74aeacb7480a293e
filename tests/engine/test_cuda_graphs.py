"""Decode steps padded into graph buckets (engine/cuda_graphs.py) give the eager path's tokens.

On a CPU the padded forward runs without capture: padding rows, their scratch slot, the
staging buffer's reuse across batch sizes and the context buckets are what is checked. On a
GPU (``device="auto"`` picks it) the default engine replays captured graphs and is compared
with ``enforce_eager``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine.llm_engine as llm_engine
from engine import LLM, SamplingParams
from engine.cuda_graphs import MIN_CONTEXT_BLOCKS, batch_buckets, context_bucket
from tests.engine.helpers import image_conv, noise_image, text_conv

ON_GPU = torch.cuda.is_available()


def test_batch_buckets_cover_every_batch() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(64)[:6] == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(64)[-1] == 64
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]


def test_context_buckets_are_powers_of_two_capped() -> None:
    assert context_bucket(1, 512) == MIN_CONTEXT_BLOCKS
    assert context_bucket(MIN_CONTEXT_BLOCKS + 1, 512) == 2 * MIN_CONTEXT_BLOCKS
    assert context_bucket(300, 512) == 512
    assert context_bucket(300, 400) == 400


@pytest.fixture
def graphed(monkeypatch):
    """LLMs built inside get decode graphs: captured on a GPU, the padded forward on a CPU."""
    if not ON_GPU:
        resolve = llm_engine.resolve_platform
        monkeypatch.setattr(
            llm_engine,
            "resolve_platform",
            lambda args: dataclasses.replace(
                resolve(args), decode_graphs="off" if args.enforce_eager else "eager"
            ),
        )


def _conversations() -> list[list[dict]]:
    return [
        text_conv("The station entrance at night"),
        image_conv("Who is here?", noise_image(112, 84, 5)),
        text_conv("a"),
        text_conv("Describe the parking lot by the river, the cars and the people " * 2),
        image_conv("Count them", noise_image(84, 112, 7)),
    ]


def test_padded_decode_steps_match_eager(tiny_checkpoint, graphed) -> None:
    """Five requests of different lengths, ending at different steps: batches 5 to 1 pad into
    buckets 6, 4, 2, 1 (max_num_seqs 6); block size 4, so contexts cross from the 16-block
    bucket into the 32-block one mid-generation."""
    kwargs = dict(dtype="float32", block_size=4, max_num_seqs=6, max_model_len=512)
    eager = LLM(str(tiny_checkpoint), enforce_eager=True, **kwargs)
    padded = LLM(str(tiny_checkpoint), **kwargs)
    graphs = padded.engine.runner.decode_graphs
    assert graphs is not None and eager.engine.runner.decode_graphs is None
    convs = _conversations()
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 9, 70, 3, 25)
    ]
    want = [o.outputs[0].token_ids for o in eager.chat(convs, params)]
    got = [o.outputs[0].token_ids for o in padded.chat(convs, params)]
    assert got == want
    assert graphs.steps > 60  # the decode steps ran padded
    if ON_GPU:
        assert {b for b, _ in graphs.captured} >= {1, 2, 4}  # replayed graphs of several sizes


def test_sampling_and_logprobs_through_padded_steps(tiny_qwen2_vl, graphed) -> None:
    """Seeded sampling and logprobs read the padded step's logits rows as the eager ones."""
    kwargs = dict(dtype="float32", max_num_seqs=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, logprobs=2)
    convs = [text_conv("hello there"), text_conv("a red car")]
    eager = LLM(str(tiny_qwen2_vl), enforce_eager=True, **kwargs).chat(convs, params)
    padded = LLM(str(tiny_qwen2_vl), **kwargs).chat(convs, params)
    for e, p in zip(eager, padded, strict=True):
        assert p.outputs[0].token_ids == e.outputs[0].token_ids
        for le, lp in zip(e.outputs[0].logprobs, p.outputs[0].logprobs, strict=True):
            assert (lp.token_id, lp.rank) == (le.token_id, le.rank)
            assert lp.logprob == pytest.approx(le.logprob, abs=1e-4)
            assert [t for t, _ in lp.top] == [t for t, _ in le.top]


def test_cpu_plan_has_no_graphs(tiny_qwen2_vl) -> None:
    llm = LLM(str(tiny_qwen2_vl), dtype="float32", device="cpu")
    assert llm.engine.platform.decode_graphs == "off"
    assert llm.engine.runner.decode_graphs is None
