"""The client's ``x-request-id`` is echoed, never used as the engine's key: two requests that
share one run side by side and each gets its own full answer."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.server.support import ServerHandle

pytestmark = pytest.mark.timeout(120)

PROMPTS = ("Describe the lobby camera.", "Count the parked cars, please.")
MAX_TOKENS = 12


def _messages(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def _reference(client: openai.AsyncOpenAI, model: str, text: str) -> str:
    resp = await client.chat.completions.create(
        model=model,
        messages=_messages(text),
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length"
    return resp.choices[0].message.content


async def _open(client: openai.AsyncOpenAI, model: str, text: str, request_id: str) -> Any:
    raw = await client.chat.completions.with_raw_response.create(
        model=model,
        messages=_messages(text),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"x-request-id": request_id},
    )
    return raw.headers, raw.parse()


async def _drain(stream: Any, chunks: list[Any]) -> str:
    async for chunk in stream:
        chunks.append(chunk)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def test_same_x_request_id_twice_concurrently_both_complete(healthy: ServerHandle):
    async with healthy.async_client() as client:
        refs = [await _reference(client, healthy.model, text) for text in PROMPTS]
        assert refs[0] != refs[1], "the two prompts must be told apart by their answers"

        # A is in the engine and streaming before B arrives with the same id.
        headers_a, stream_a = await _open(client, healthy.model, PROMPTS[0], "dup-id")
        chunks_a = [await stream_a.__anext__()]
        headers_b, stream_b = await _open(client, healthy.model, PROMPTS[1], "dup-id")
        chunks_b: list[Any] = []
        text_a, text_b = await asyncio.wait_for(
            asyncio.gather(_drain(stream_a, chunks_a), _drain(stream_b, chunks_b)), timeout=60
        )

    assert headers_a["x-request-id"] == headers_b["x-request-id"] == "dup-id"
    assert (text_a, text_b) == (refs[0], refs[1])
    assert chunks_a[-1].choices[0].finish_reason == "length"
    assert chunks_b[-1].choices[0].finish_reason == "length"
    assert chunks_a[0].id != chunks_b[0].id  # response ids come from the engine's own ids

    records = [r for r in healthy.app.state.metrics.recent if r.client_request_id == "dup-id"]
    assert len(records) == 2
    assert len({r.id for r in records}) == 2
    assert all(r.status == 200 and r.output_tokens == MAX_TOKENS for r in records)


def test_x_request_id_is_echoed_and_logged_without_being_the_engine_id(healthy: ServerHandle):
    with healthy.client() as client:
        raw = client.chat.completions.with_raw_response.create(
            model=healthy.model,
            messages=_messages("Hi"),
            max_tokens=2,
            extra_headers={"x-request-id": "client-42"},
        )
    resp = raw.parse()
    assert raw.headers["x-request-id"] == "client-42"
    assert resp.id != "chatcmpl-client-42"
    engine_id = resp.id.removeprefix("chatcmpl-")
    record = next(r for r in healthy.app.state.metrics.recent if r.id == engine_id)
    assert record.client_request_id == "client-42"
    assert record.log_fields()["client_request_id"] == "client-42"
