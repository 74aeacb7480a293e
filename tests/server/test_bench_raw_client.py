"""The benchmarks' raw SSE client (benchmarks/sse_client.py) reads the same stream the OpenAI
SDK does (the benchmarks' ``--client openai`` path): the same content, event for event, from
the real server; errors are raised, not counted as empty completions (a benchmark that recorded
a refused request as a fast one would report nonsense)."""

from __future__ import annotations

import pytest

from benchmarks.serve_mixed import openai_content_events
from benchmarks.sse_client import RawChatClient, StreamError

from .support import API_KEY, ServerHandle

MESSAGES = [{"role": "user", "content": "Describe the bus stop in one sentence."}]


async def test_raw_client_reads_what_the_sdk_reads(server: ServerHandle, async_client) -> None:
    extra = {"ignore_eos": True}
    raw = RawChatClient(server.v1, API_KEY, timeout=60)
    pieces = [p async for p in raw.content_events(server.model, MESSAGES, 24, extra)]
    sdk = [p async for p in openai_content_events(async_client, server.model, MESSAGES, 24, extra)]
    assert pieces == sdk and len(pieces) > 1


async def test_raw_client_raises_on_errors(server: ServerHandle) -> None:
    raw = RawChatClient(server.v1, API_KEY, timeout=60)
    with pytest.raises(StreamError, match="HTTP 404"):
        async for _ in raw.content_events("no-such-model", MESSAGES, 4, None):
            pass
    wrong_key = RawChatClient(server.v1, "not-the-key", timeout=60)
    with pytest.raises(StreamError, match="HTTP 401"):
        async for _ in wrong_key.content_events(server.model, MESSAGES, 4, None):
            pass
    with pytest.raises(ValueError, match="plain http"):
        RawChatClient("https://example.com/v1", API_KEY, timeout=1)
