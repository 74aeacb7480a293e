"""The streaming chunk formatter's hot path gives the bytes the response models give.

``_ChunkWriter`` encodes the fields every chunk repeats once and builds a plain text delta
without the pydantic models (per-token CPU on the event loop); these tests hold its output to
the models' own dump, byte for byte, over the texts JSON escaping cares about."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vision_serve.protocol import ChoiceDelta, ChunkChoice, CompletionChoice, Usage
from vision_serve.serving import _ChunkWriter

TEXTS = [
    "",
    "hello",
    ' a "quoted" \\ word',
    "line\nbreak\ttab",
    "ünïcödé 你好 🎥",
    "\u2028\x00\x1f",
]


def models_event(
    endpoint: str, include_usage: bool, choice: dict[str, Any], usage: Usage | None = None
) -> str:
    """The chunk as the response models describe it (the formatter before its fast path)."""
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk" if endpoint == "chat" else "text_completion",
        "created": 1700000000,
        "model": 'm/o"del',
        "system_fingerprint": None,
        "choices": [choice] if choice else [],
    }
    if include_usage:
        body["usage"] = usage.model_dump(exclude_none=True) if usage else None
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def writer(endpoint: str, include_usage: bool) -> _ChunkWriter:
    return _ChunkWriter(endpoint, "chatcmpl-1", 1700000000, 'm/o"del', include_usage)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("text", TEXTS)
def test_text_deltas_are_the_models_bytes(endpoint: str, include_usage: bool, text: str) -> None:
    for index in (0, 3):
        if endpoint == "chat":
            delta = ChoiceDelta(content=text)
            choice = ChunkChoice(index=index, delta=delta).model_dump()
            choice["delta"] = delta.model_dump(exclude_none=True)
        else:
            choice = CompletionChoice(index=index, text=text).model_dump()
        got = writer(endpoint, include_usage).content(text, index=index)
        assert got == models_event(endpoint, include_usage, choice)
        assert json.loads(got.removeprefix("data: "))["choices"][0]["index"] == index


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_logprobs_finish_and_usage_chunks_are_the_models_bytes(
    endpoint: str, include_usage: bool
) -> None:
    w = writer(endpoint, include_usage)
    logprobs = {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]}
    if endpoint == "chat":
        delta = ChoiceDelta(content="a")
        choice = ChunkChoice(index=1, delta=delta, logprobs=logprobs).model_dump()
        choice["delta"] = delta.model_dump(exclude_none=True)
        finish = ChunkChoice(index=1, delta=ChoiceDelta(), finish_reason="stop").model_dump()
        finish["delta"] = {}
    else:
        choice = CompletionChoice(index=1, text="a", logprobs=logprobs).model_dump()
        finish = CompletionChoice(index=1, text="", finish_reason="stop").model_dump()
    assert w.content("a", index=1, logprobs=logprobs) == models_event(
        endpoint, include_usage, choice
    )
    assert w.finish("stop", index=1) == models_event(endpoint, include_usage, finish)
    usage = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    if include_usage:
        assert w.usage(usage) == models_event(endpoint, True, {}, usage)
