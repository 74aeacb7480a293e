"""Structured output and tools over HTTP with the official ``openai`` client, on a random-weight
checkpoint: only constrained decoding can make these outputs parse and validate."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Any

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from vision_serve.settings import ServerSettings

from .support import API_KEY, ServerHandle, make_engine, make_image, start_server


@pytest.fixture(scope="module")
def so_server(checkpoint) -> Iterator[ServerHandle]:
    """Its own engine: a 4k context for Frigate's long prompt and schema, and a 64-token step
    budget so prompts are prefilled in chunks."""
    engine = make_engine(str(checkpoint), max_model_len=4096, num_kv_blocks=1024)
    handle = start_server(engine, ServerSettings(api_key=API_KEY))
    yield handle
    handle.stop()
    engine.shutdown()


@pytest.fixture
def client(so_server: ServerHandle) -> Iterator[openai.OpenAI]:
    with so_server.client() as c:
        yield c


class Activity(StrEnum):
    walking = "walking"
    loitering = "loitering"
    delivering = "delivering"


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    activity: Activity
    carrying: list[bool] = Field(max_length=2)


class Sighting(BaseModel):
    model_config = ConfigDict(extra="forbid")
    people: list[Person] = Field(max_length=2)
    threat: int = Field(ge=0, le=2)
    vehicle: bool


def _strict_format(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "sighting", "strict": True, "schema": model.model_json_schema()},
    }


MESSAGES = [{"role": "user", "content": "Who is at the door? Answer as JSON."}]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}])
def test_json_schema_strict_validates(client, so_server, sampling):
    resp = client.chat.completions.create(
        model=so_server.model,
        messages=MESSAGES,
        response_format=_strict_format(Sighting),
        max_tokens=300,
        **sampling,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    Sighting.model_validate_json(choice.message.content)


def test_json_schema_streamed_validates(client, so_server):
    stream = client.chat.completions.create(
        model=so_server.model,
        messages=MESSAGES,
        response_format=_strict_format(Sighting),
        max_tokens=300,
        temperature=1.0,
        seed=11,
        stream=True,
    )
    text, reasons = "", []
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    Sighting.model_validate_json(text)


def test_parse_with_a_pydantic_model(client, so_server):
    resp = client.chat.completions.parse(
        model=so_server.model, messages=MESSAGES, response_format=Sighting, max_tokens=300
    )
    assert isinstance(resp.choices[0].message.parsed, Sighting)


def test_json_object_is_json_or_cut_by_length(client, so_server):
    resp = client.chat.completions.create(
        model=so_server.model,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    choice = resp.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_guided_regex_and_choice_extra_body(client, so_server):
    resp = client.chat.completions.create(
        model=so_server.model,
        messages=MESSAGES,
        extra_body={"guided_regex": r"zone-[0-9]{2}"},
        temperature=1.0,
        seed=3,
    )
    assert resp.choices[0].message.content.startswith("zone-")
    assert len(resp.choices[0].message.content) == 7
    done = client.completions.create(
        model=so_server.model,
        prompt="Is the gate open?",
        extra_body={"guided_choice": ["open", "closed"]},
    )
    assert done.choices[0].text in ("open", "closed")
    newer = client.chat.completions.create(
        model=so_server.model,
        messages=MESSAGES,
        extra_body={"structured_outputs": {"choice": ["cat", "dog"]}},
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in newer) in ("cat", "dog")


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
            "response_format",
        ),
    ],
)
def test_bad_constraint_is_a_400_naming_the_field(client, so_server, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=so_server.model, messages=MESSAGES, **body)
    assert err.value.body["param"] == param


# ---- Frigate's GenAI OpenAI provider --------------------------------------------------------

ObservationItem = Annotated[str, StringConstraints(min_length=20, max_length=200)]


class ReviewMetadata(BaseModel):
    """frigate/data_processing/post/types.py (dev), field for field."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    observations: list[ObservationItem] = Field(
        ...,
        min_length=3,
        max_length=8,
        description="Enumerate the significant observations across all frames, in "
        "chronological order.",
    )
    scene: str = Field(min_length=150, max_length=600, description="A chronological narrative.")
    title: str = Field(max_length=80, description="Title for the activity.")
    shortSummary: str = Field(
        min_length=70, max_length=140, description="A brief summary for the activity."
    )
    confidence: float = Field(ge=0.0, le=1.0, description="Confidence in the analysis.")
    potential_threat_level: int = Field(ge=0, le=2, description="Threat level: 0, 1 or 2.")
    other_concerns: list[str] | None = Field(default=None, description="Other concerns.")
    time: str | None = Field(default=None, description="Time of activity.")


def _frigate_response_format() -> dict[str, Any]:
    """frigate/genai/prompts.py ``build_review_description_response_format([])`` plus what
    the OpenAI plugin adds for strict mode (``additionalProperties: false``)."""
    schema = ReviewMetadata.model_json_schema()
    schema["properties"].pop("time", None)
    schema["properties"].pop("other_concerns", None)
    schema["additionalProperties"] = False
    return {
        "type": "json_schema",
        "json_schema": {"name": "review_metadata", "strict": True, "schema": schema},
    }


FRIGATE_PROMPT = """
Your task is to analyze a sequence of images taken in chronological order from a security camera.

## Task Instructions

Describe the scene based on observable actions and movements, evaluate the activity against the
Activity Indicators above, and assign a potential_threat_level (0, 1, or 2).

## Response Field Guidelines

Respond with a JSON object matching the provided schema.

## Sequence Details

- Camera: front_door
- Total frames: 2 (Frame 1 = earliest, Frame 2 = latest)
- Activity started at 2026-12-01 08:00:00 and lasted 12 seconds
- Zones involved: porch

## Objects in Scene

- person
"""


def test_frigate_review_request_validates(client, so_server):
    """The request frigate/genai/plugins/openai.py ``_send`` makes (dev branch): one user
    message, the prompt text first, then each thumbnail as a JPEG data URL with
    ``detail: low``; the strict json_schema response_format; no max_tokens or temperature
    (``runtime_options`` is empty by default)."""
    thumbnails = []
    for color in ((40, 80, 160), (160, 80, 40)):
        img = make_image(64, 64, color)
        buf = io.BytesIO()
        img.save(buf, format="JPEG")
        thumbnails.append(buf.getvalue())
    content: list[dict[str, Any]] = [{"type": "text", "text": FRIGATE_PROMPT}]
    for image in thumbnails:
        b64 = base64.b64encode(image).decode("utf-8")
        content.append(
            {
                "type": "image_url",
                "image_url": {"url": f"data:image/jpeg;base64,{b64}", "detail": "low"},
            }
        )
    result = client.chat.completions.create(
        model=so_server.model,
        messages=[{"role": "user", "content": content}],
        timeout=120,
        response_format=_frigate_response_format(),
    )
    assert result.choices[0].finish_reason == "stop"
    metadata = ReviewMetadata.model_validate_json(result.choices[0].message.content.strip())
    assert 3 <= len(metadata.observations) <= 8


# ---- tools ----------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "description": "Arm or disarm a zone.",
            "parameters": {
                "type": "object",
                "properties": {
                    "zone": {"type": "string", "enum": ["porch", "garage"]},
                    "armed": {"type": "boolean"},
                },
                "required": ["zone", "armed"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "snapshot",
            "parameters": {
                "type": "object",
                "properties": {"camera": {"type": "string", "enum": ["front", "back"]}},
                "required": ["camera"],
                "additionalProperties": False,
            },
        },
    },
]
ARGS = {
    "set_alarm": lambda a: a["zone"] in ("porch", "garage") and isinstance(a["armed"], bool),
    "snapshot": lambda a: a["camera"] in ("front", "back"),
}


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        args = json.loads(call.function.arguments)
        assert ARGS[call.function.name](args)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "snapshot"}}]
)
def test_forced_tool_call(client, so_server, choice):
    resp = client.chat.completions.create(
        model=so_server.model,
        messages=[{"role": "user", "content": "Arm the porch."}],
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,  # random weights would add calls up to max_tokens
        temperature=1.0,
        seed=4,
        max_tokens=200,
    )
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    _check_calls(c.message.tool_calls)
    if isinstance(choice, dict):
        assert [t.function.name for t in c.message.tool_calls] == ["snapshot"]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}]
)
def test_forced_tool_call_streamed(client, so_server, choice):
    stream = client.chat.completions.create(
        model=so_server.model,
        messages=[{"role": "user", "content": "Arm the porch."}],
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reason = chunk.choices[0].finish_reason or reason
        assert not delta.content
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the first entry of a call names it
                assert tc.id.startswith("call_") and tc.function.name
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.function.arguments or ""
    assert reason == "tool_calls" and calls
    for call in calls.values():
        assert ARGS[call["name"]](json.loads(call["arguments"]))


def test_tool_conversation_and_tool_choice_none(client, so_server):
    """Assistant tool calls and tool results are accepted as input; ``none`` answers in text."""
    messages = [
        {"role": "user", "content": "Snapshot the front camera."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "snapshot", "arguments": '{"camera": "front"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "saved /clips/1.jpg"},
    ]
    resp = client.chat.completions.create(
        model=so_server.model,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason in ("stop", "length")
    auto = client.chat.completions.create(
        model=so_server.model, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tool_choice_is_a_400(client, so_server, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=so_server.model, messages=MESSAGES, tools=TOOLS, **body
        )
    assert err.value.body["param"] == param
