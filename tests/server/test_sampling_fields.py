"""``logprobs``/``top_logprobs``, ``n``, penalties and ``logit_bias`` through the official
``openai`` client, checked against the offline engine and against each other (streamed and not)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine import SamplingParams

from .support import data_url, image_message, make_image

MESSAGES = [{"role": "user", "content": "Who walked past the front door this morning?"}]


def offline_output(llm: Any, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return llm.chat(messages, SamplingParams(**kw))[0].outputs[0]


def test_chat_logprobs_equal_the_engines_and_spell_the_text(client, server, offline):
    resp = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        temperature=0,
        max_tokens=10,
        logprobs=True,
        top_logprobs=3,
    )
    choice = resp.choices[0]
    expected = offline_output(offline, MESSAGES, temperature=0, max_tokens=10, logprobs=3)
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens == len(expected.token_ids)
    for entry, lp in zip(content, expected.logprobs, strict=True):
        assert math.isclose(entry.logprob, lp.logprob, abs_tol=1e-5)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    raw = b"".join(bytes(entry.bytes) for entry in content)
    if choice.finish_reason == "length":  # nothing held back or cut: the bytes are the text
        assert raw.decode("utf-8", errors="replace") == choice.message.content


def test_logprobs_without_top_logprobs_give_empty_alternatives(client, server):
    resp = client.chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=0, max_tokens=4, logprobs=True
    )
    assert all(e.top_logprobs == [] for e in resp.choices[0].logprobs.content)
    plain = client.chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=0, max_tokens=4
    )
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_equal_the_non_streamed(client, server):
    kw: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES, **kw)
    stream = client.chat.completions.create(
        model=server.model, messages=MESSAGES, stream=True, **kw
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in whole.choices[0].logprobs.content
    ]


def test_completion_logprobs_in_the_legacy_shape(client, server):
    resp = client.completions.create(
        model=server.model,
        prompt="The camera on the porch saw",
        temperature=0,
        max_tokens=8,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 2 <= len(top) <= 3 and top[token] == value  # the sampled token is always there
        assert value == max(top.values())  # greedy


def test_n_choices_are_seeded_distinct_and_reproducible(client, server):
    kw: dict[str, Any] = {"temperature": 1.0, "seed": 7, "max_tokens": 12, "n": 3}
    first = client.chat.completions.create(model=server.model, messages=MESSAGES, **kw)
    again = client.chat.completions.create(model=server.model, messages=MESSAGES, **kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) == 3
    one_by_one = [
        client.chat.completions.create(
            model=server.model, messages=MESSAGES, temperature=1.0, seed=7 + i, max_tokens=12
        )
        for i in range(3)
    ]
    assert [r.choices[0].message.content for r in one_by_one] == texts  # choice i: seed + i
    assert first.usage.prompt_tokens == one_by_one[0].usage.prompt_tokens
    assert first.usage.completion_tokens == sum(r.usage.completion_tokens for r in one_by_one)


def test_streamed_n_choices_equal_the_non_streamed(client, server):
    kw: dict[str, Any] = {"temperature": 1.0, "seed": 3, "max_tokens": 10, "n": 2}
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES, **kw)
    stream = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_of_an_image_prompt_share_its_prefill(client, server, engine):
    """The first choice computes the prompt; the others find its KV blocks cached."""
    messages = image_message("Describe the scene in detail.", data_url(make_image(224, 224)))
    before = engine.get_stats()
    resp = client.chat.completions.create(
        model=server.model, messages=messages, temperature=1.0, seed=1, max_tokens=4, n=4
    )
    after = engine.get_stats()
    prompt = resp.usage.prompt_tokens
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    block = engine.engine.args.block_size
    assert hits >= 3 * (prompt // block) * block  # choices 1..3 reuse every full block
    assert len(resp.choices) == 4


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_and_penalties_reach_the_sampler(client, server, offline, stream):
    kw: dict[str, Any] = {
        "temperature": 0,
        "max_tokens": 8,
        "frequency_penalty": 1.5,
        "presence_penalty": 0.5,
        "logit_bias": {"17": 100},
        "extra_body": {"repetition_penalty": 1.2, "ignore_eos": True},
    }
    resp = client.chat.completions.create(
        model=server.model, messages=MESSAGES, stream=stream, **kw
    )
    text = (
        "".join(c.choices[0].delta.content or "" for c in resp if c.choices)
        if stream
        else resp.choices[0].message.content
    )
    expected = offline_output(
        offline,
        MESSAGES,
        temperature=0,
        max_tokens=8,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={17: 100.0},
    )
    assert text == expected.text
    assert expected.token_ids[0] == 17  # a +100 bias wins whatever the weights
