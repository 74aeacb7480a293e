"""Correctness anchor: greedy output equals ``transformers`` ``generate()`` token for token."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.helpers import hf_greedy, image_conv, noise_image, text_conv, truncate_at_eos

MAX_NEW = 24


@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    cache: dict = {}

    def get(path):
        if path not in cache:
            cache[path] = LLM(str(path), dtype="float32", max_num_batched_tokens=2048)
        return cache[path]

    return get


def _greedy(max_tokens=MAX_NEW):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _assert_same(llm, checkpoint, conversation, out):
    ref = truncate_at_eos(hf_greedy(checkpoint, conversation, MAX_NEW), llm.engine.eos_token_ids)
    assert out.outputs[0].token_ids == ref


def test_text_only(engines, tiny_checkpoint):
    llm = engines(tiny_checkpoint)
    conv = text_conv("Describe the people walking past the shop window.")
    _assert_same(llm, tiny_checkpoint, conv, llm.chat(conv, _greedy())[0])


def test_one_image(engines, tiny_checkpoint):
    llm = engines(tiny_checkpoint)
    conv = image_conv("What is happening here?", noise_image(140, 112, seed=1))
    out = llm.chat(conv, _greedy())[0]
    assert out.num_image_tokens > 0
    _assert_same(llm, tiny_checkpoint, conv, out)


def test_two_images_in_one_prompt(engines, tiny_checkpoint):
    llm = engines(tiny_checkpoint)
    conv = image_conv(
        "Compare the two frames.", noise_image(112, 112, seed=2), noise_image(168, 84, seed=3)
    )
    _assert_same(llm, tiny_checkpoint, conv, llm.chat(conv, _greedy())[0])


def test_eight_concurrent_requests_of_different_lengths(engines, tiny_checkpoint):
    llm = engines(tiny_checkpoint)
    convs = []
    for i in range(8):
        if i % 3 == 0:
            convs.append(
                image_conv("camera " * (i + 1), noise_image(84 + 28 * i, 112, seed=10 + i))
            )
        else:
            convs.append(text_conv("a person crosses the road " * (i + 1)))
    params = [_greedy(8 + 2 * i) for i in range(8)]
    outs = llm.chat(convs, params)
    assert len(outs) == 8
    for i, (conv, out) in enumerate(zip(convs, outs, strict=True)):
        ref = truncate_at_eos(hf_greedy(tiny_checkpoint, conv, 8 + 2 * i), llm.engine.eos_token_ids)
        assert out.outputs[0].token_ids == ref, f"request {i}"
