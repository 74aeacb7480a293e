"""Penalties, ``logit_bias`` and logprobs: checked against ``transformers`` where it has the
same feature (repetition penalty, raw logits), and against the definitions elsewhere."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.sampler import apply_penalties, sample
from tests.engine.helpers import hf_greedy, step_logits, text_conv, truncate_at_eos

MAX_NEW = 20
PROMPT = "the camera sees a person at the door, the person waits at the door and the camera"


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(str(tiny_qwen2_vl), dtype="float32", max_num_batched_tokens=2048)


def test_repetition_penalty_matches_transformers(llm, tiny_qwen2_vl):
    """CTRL's penalty over prompt and generated tokens, as ``generate(repetition_penalty=)``."""
    conv = text_conv(PROMPT)
    for penalty in (1.3, 0.7):
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, repetition_penalty=penalty)
        ours = llm.chat(conv, params)[0].outputs[0].token_ids
        ref = hf_greedy(tiny_qwen2_vl, conv, MAX_NEW, repetition_penalty=penalty)
        assert ours == truncate_at_eos(ref, llm.engine.eos_token_ids), penalty
    plain = llm.chat(conv, SamplingParams(temperature=0, max_tokens=MAX_NEW))[0]
    strong = llm.chat(conv, SamplingParams(temperature=0, max_tokens=MAX_NEW, repetition_penalty=3))
    assert plain.outputs[0].token_ids != strong[0].outputs[0].token_ids


def test_presence_and_frequency_penalties_follow_openais_definition():
    """logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty."""
    row = torch.linspace(-2, 2, 10)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = row.clone()
    apply_penalties(out, p, prompt_ids=[9, 9, 8], output_ids=[3, 3, 3, 7])
    expected = row.clone()
    expected[3] -= 3 * 0.25 + 0.5
    expected[7] -= 1 * 0.25 + 0.5
    assert torch.equal(out, expected)  # prompt tokens 8, 9 untouched


def test_a_large_frequency_penalty_stops_greedy_repeating(llm):
    conv = text_conv(PROMPT)
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0
    )
    plain = llm.chat(conv, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    penalised = llm.chat(conv, params)[0].outputs[0].token_ids
    assert len(set(penalised)) > len(set(plain.outputs[0].token_ids))


def test_logit_bias_forces_and_bans_tokens(llm):
    conv = text_conv(PROMPT)
    plain = llm.chat(conv, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    first = plain.outputs[0].token_ids[0]
    banned = llm.chat(
        conv,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={first: -100}),
    )[0]
    assert first not in banned.outputs[0].token_ids
    target = 123
    for seed in (1, 2):
        forced = llm.chat(
            conv,
            SamplingParams(
                temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True, logit_bias={target: 100}
            ),
        )[0]
        assert forced.outputs[0].token_ids == [target] * 6


def test_logprobs_are_the_models_raw_log_softmax(llm):
    """The sampled token's logprob and the top-k equal ``log_softmax`` of the step's logits
    (before a penalty changed them), ranks count better tokens, greedy picks rank 1."""
    conv = text_conv(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, repetition_penalty=1.5)
    logits = step_logits(llm, conv, params)
    out = llm.chat(conv, params)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for step, (lp, token) in enumerate(zip(out.logprobs, out.token_ids, strict=True)):
        ref = torch.log_softmax(logits[step][0].double(), dim=-1)
        assert lp.token_id == token
        assert math.isclose(lp.logprob, float(ref[token]), abs_tol=1e-4)
        assert lp.rank == int((ref > ref[token] + 1e-6).sum()) + 1
        top_ids = torch.topk(ref, 3).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
        assert all(a >= b for (_, a), (_, b) in zip(lp.top, lp.top[1:], strict=False))
    plain = llm.chat(conv, SamplingParams(temperature=0, max_tokens=8, logprobs=0))[0].outputs[0]
    assert all(lp.rank == 1 and lp.top == [] for lp in plain.logprobs)


def test_logprobs_match_transformers_raw_logits(llm, tiny_qwen2_vl):
    from tests.engine.helpers import _hf

    processor, model = _hf(str(tiny_qwen2_vl))
    conv = text_conv(PROMPT)
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=6, logprobs=0))[0].outputs[0]
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    enc = processor(text=[text], return_tensors="pt")
    with torch.inference_mode():
        gen = model.generate(
            **enc,
            max_new_tokens=len(out.token_ids),
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    for lp, step_logits_hf in zip(out.logprobs, gen.logits, strict=True):
        ref = torch.log_softmax(step_logits_hf[0].double(), dim=-1)
        assert math.isclose(lp.logprob, float(ref[lp.token_id]), abs_tol=1e-3)


def test_streamed_deltas_carry_one_logprob_per_token(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    engine.add_request("lp", text_conv(PROMPT), params)
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            comp = out.outputs[0]
            assert len(comp.delta_logprobs) == len(comp.delta_token_ids)
            deltas += comp.delta_logprobs
            if out.finished:
                final = comp
    assert final is not None and [lp.token_id for lp in deltas] == final.token_ids
    assert [lp.logprob for lp in final.logprobs] == [lp.logprob for lp in deltas]


def test_rows_without_features_are_untouched_by_their_neighbours():
    """A batch mixing penalised, biased and plain rows samples the plain row as if alone."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    plain = SamplingParams(temperature=0)
    rows = [SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={4: 5.0}), plain]
    rows.append(SamplingParams(temperature=0, frequency_penalty=1.0))
    histories = [([1, 2], [3]), ([], []), ([], [int(logits[2].argmax())])]
    out = sample(logits.clone(), rows, [None] * 3, [[], [], []], histories)
    assert out.token_ids[1] == int(logits[1].argmax())
    assert out.logprobs == [None, None, None]


def test_min_p_keeps_only_tokens_near_the_best():
    """vLLM's min-p: after temperature, tokens below min_p x the best probability are never
    drawn; min_p 1 leaves only the best token, whatever the seed."""
    logits = torch.tensor([[4.0, 3.5, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits[0], -1)
    allowed = {i for i in range(5) if probs[i] >= 0.3 * probs.max()}
    assert allowed == {0, 1}
    seen = set()
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        out = sample(logits.clone(), [SamplingParams(min_p=0.3)], [gen], [[]])
        seen.add(out.token_ids[0])
    assert seen == allowed
    gen = torch.Generator().manual_seed(0)
    only = sample(logits.clone(), [SamplingParams(min_p=1.0, temperature=2.0)], [gen], [[]])
    assert only.token_ids == [0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logprobs", 21),
        ("logprobs", True),
    ],
)
def test_out_of_range_values_are_refused_at_the_door(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    vocab = llm.engine.hf_config.text_config.vocab_size
    with pytest.raises(InvalidRequestError, match="out of the vocabulary"):
        llm.chat(text_conv("hi"), SamplingParams(logit_bias={vocab: 1.0}))
