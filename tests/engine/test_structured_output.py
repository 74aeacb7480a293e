"""Constrained decoding in the engine: on random weights only the grammar can make the output
valid, so every finished ``stop`` output here parsing and validating is the grammar at work,
through chunked prefill, preemption, prefix caching and mixed batches."""

from __future__ import annotations

import json
import re
from enum import StrEnum

import pytest
from pydantic import BaseModel, Field

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutputsParams
from tests.engine.helpers import text_conv


class Activity(StrEnum):
    walking = "walking"
    standing = "standing"
    running = "running"


class Person(BaseModel):
    activity: Activity
    carrying: list[bool] = Field(max_length=3)
    count: int = Field(ge=0, le=9)


class Report(BaseModel):
    people: list[Person] = Field(max_length=3)
    threat: int = Field(ge=0, le=2)
    vehicle: bool


SCHEMA = {**Report.model_json_schema(), "additionalProperties": False}
SPEC = StructuredOutputsParams(json=SCHEMA)


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    # a 16-token step budget: every prompt here is prefilled in several chunks
    return LLM(str(tiny_qwen2_vl), dtype="float32", max_num_batched_tokens=16, max_model_len=2048)


def _params(temperature: float = 0.0, seed: int | None = None, **kw) -> SamplingParams:
    kw.setdefault("structured_outputs", SPEC)
    return SamplingParams(max_tokens=400, temperature=temperature, seed=seed, **kw)


def _valid_report(out) -> Report:
    comp = out.outputs[0]
    assert comp.finish_reason == "stop", comp.text
    return Report.model_validate_json(comp.text)


def test_json_schema_greedy_and_sampled_outputs_validate(llm):
    prompt = "Describe the people in the camera frame as JSON. " * 3
    params = [_params()] + [_params(1.0, seed) for seed in range(2)]
    outs = llm.chat([text_conv(prompt)] * len(params), params)
    for out in outs:
        _valid_report(out)
    # a seeded constrained request is reproducible
    again = llm.chat([text_conv(prompt)], [_params(1.0, 1)])[0]
    assert again.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_regex_choice_and_json_object(llm):
    specs = [
        StructuredOutputsParams(regex=r"(cam|door)-[0-9]{2}: (yes|no)"),
        StructuredOutputsParams(choice=["person", "car", 'a "quoted" dog']),
        StructuredOutputsParams(json_object=True),
    ]
    params = [_params(t, 7, structured_outputs=s) for s in specs for t in (0.0, 1.0)]
    outs = llm.chat([text_conv("What is it?")] * len(params), params)
    for out in outs[:2]:
        assert re.fullmatch(r"(cam|door)-[0-9]{2}: (yes|no)", out.outputs[0].text)
    for out in outs[2:4]:
        assert out.outputs[0].text in ("person", "car", 'a "quoted" dog')
    for out in outs[4:]:
        comp = out.outputs[0]
        # any JSON object: unbounded strings may run to max_tokens on random weights
        if comp.finish_reason == "stop":
            assert isinstance(json.loads(comp.text), dict)
        else:
            assert comp.finish_reason == "length" and comp.text.startswith("{")


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(llm):
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    convs = [text_conv(f"camera {i} reports activity near the gate") for i in range(3)]
    alone = [o.outputs[0].token_ids for o in llm.chat(convs, plain)]
    mixed = llm.chat(convs + convs, [plain] * 3 + [_params(1.0, i) for i in range(3)])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for out in mixed[3:]:
        _valid_report(out)


def test_grammar_survives_preemption(tiny_qwen2_vl):
    """Recompute after preemption keeps the output tokens; the matcher is advanced once per
    token (had it been advanced twice, the grammar would reject and the JSON break)."""
    convs = [text_conv(f"request {i}: describe the scene " * (1 + i % 3)) for i in range(6)]
    spec = StructuredOutputsParams(regex=r"(cam|door)-[0-9]{2}: [a-z ]{30}")
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured_outputs=spec)
        for i in range(6)
    ]
    roomy = LLM(str(tiny_qwen2_vl), dtype="float32", block_size=4)
    reference = [o.outputs[0].token_ids for o in roomy.chat(convs, params)]
    # each request needs up to ~25 blocks of 4 by the end; 40 blocks cannot hold all six
    tight = LLM(str(tiny_qwen2_vl), dtype="float32", block_size=4, num_kv_blocks=40)
    outs = tight.chat(convs, params)
    assert tight.engine.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(r"(cam|door)-[0-9]{2}: [a-z ]{30}", out.outputs[0].text)


def test_prefix_cache_hit_gives_the_same_constrained_output(llm):
    conv = text_conv("A long shared description of the driveway camera. " * 4)
    first = llm.chat([conv], [_params()])[0]
    second = llm.chat([conv], [_params()])[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    _valid_report(second)


def test_complete_grammar_stops_even_with_ignore_eos(llm):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.chat(
        [text_conv("Is anyone there?")], [_params(ignore_eos=True, structured_outputs=spec)]
    )
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
        StructuredOutputsParams(json="{not json"),
        StructuredOutputsParams(regex="(unclosed"),
    ],
)
def test_bad_spec_is_refused_at_admission(llm, spec):
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request("bad", "hi", SamplingParams(structured_outputs=spec))
    assert err.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished()


def test_spec_needs_exactly_one_constraint():
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["a"]))
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=[]))


def test_length_bounded_strings_refuse_control_characters(llm):
    """xgrammar 0.2.9 admits raw control characters in strings with minLength/maxLength
    (invalid JSON); the compiler's grammar must not."""
    spec = StructuredOutputsParams(json={"type": "string", "minLength": 2, "maxLength": 9})
    for bad in ('"a\x01', '"a\t'):
        assert not llm.engine.grammar_compiler().new_state(spec).matcher.accept_string(bad)
    assert llm.engine.grammar_compiler().new_state(spec).matcher.accept_string('"ab"')
