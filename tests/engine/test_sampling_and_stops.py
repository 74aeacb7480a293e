"""Sampling parameters and stop conditions behave as OpenAI/vLLM users expect."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.helpers import text_conv


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(str(tiny_qwen2_vl), dtype="float32")


CONV = text_conv("Tell me about the people on the platform.")


def test_seeded_sampling_is_reproducible_regardless_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
    alone = llm.chat(CONV, params)[0].outputs[0].token_ids
    others = [text_conv("other request"), text_conv("yet another one, longer than that")]
    batched = llm.chat(
        [CONV, *others],
        [
            params,
            SamplingParams(temperature=1.0, max_tokens=20),
            SamplingParams(temperature=0.7, max_tokens=9),
        ],
    )
    assert batched[0].outputs[0].token_ids == alone
    different = llm.chat(CONV, SamplingParams(temperature=1.0, seed=99, max_tokens=20))[0]
    assert different.outputs[0].token_ids != alone


def test_max_tokens_finishes_with_length(llm):
    out = llm.chat(CONV, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 7
    assert out.outputs[0].finish_reason == "length"


def test_stop_token_ids(llm):
    full = llm.chat(CONV, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_at = full.outputs[0].token_ids[4]
    first = full.outputs[0].token_ids.index(stop_at)
    out = llm.chat(CONV, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == full.outputs[0].token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_stop_string_truncates_text(llm):
    full = llm.chat(CONV, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    text = full.outputs[0].text
    stop = text[5:8]
    assert stop.strip(), "need a visible stop string"
    out = llm.chat(
        CONV, SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True)
    )[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[: text.index(stop)]


def test_min_tokens_suppresses_eos(llm):
    eos = sorted(llm.engine.eos_token_ids)
    out = llm.chat(CONV, SamplingParams(temperature=0, max_tokens=10, min_tokens=10))[0]
    assert len(out.outputs[0].token_ids) == 10
    assert not set(out.outputs[0].token_ids) & set(eos)


def test_streamed_deltas_add_up_to_the_text(llm):
    eng = llm.engine
    eng.add_request("s", CONV, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    deltas, final = [], None
    while eng.has_unfinished():
        for out in eng.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert "".join(deltas) == final.outputs[0].text
    assert final.outputs[0].text == llm.get_tokenizer().decode(
        final.outputs[0].token_ids, skip_special_tokens=True
    )
