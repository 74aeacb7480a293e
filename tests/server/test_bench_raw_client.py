"""The benchmarks' raw SSE client (benchmarks/sse_client.py) reads the same stream the OpenAI
SDK does (the benchmarks' ``--client openai`` path): the same content, event for event, from
the real server; errors are raised, not counted as empty completions (a benchmark that recorded
a refused request as a fast one would report nonsense)."""

from __future__ import annotations

import asyncio
import json

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


async def _one_shot_server(body: bytes) -> tuple[asyncio.AbstractServer, str]:
    """A server that answers any request with ``body`` (status line and headers included) and
    closes: what another OpenAI-compatible server might send, byte for byte."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1"


def _chunked(*pieces: bytes) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def _event(content: str, space: bool = True, crlf: bool = False) -> bytes:
    data = json.dumps({"choices": [{"index": 0, "delta": {"content": content}}]}).encode()
    end = b"\r\n\r\n" if crlf else b"\n\n"
    return (b"data: " if space else b"data:") + data + end


async def _collect(base_url: str) -> list[str]:
    raw = RawChatClient(base_url, "k", timeout=10)
    return [p async for p in raw.content_events("m", MESSAGES, 8, None)]


async def test_raw_client_parses_other_servers_framing() -> None:
    """Events without the space after ``data:``, CRLF line ends split across chunks, several
    events in one chunk, an event cut across chunks, comments and an empty role delta."""
    stream = b"".join([_event("a"), _event("b", space=False), _event("c", crlf=True)])
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    cut = stream.index(b"\r\n\r\n") + 1  # between the CR and the LF
    pieces = [b": keep-alive\n\n" + role, stream[:5], stream[5:cut], stream[cut:]]
    server, url = await _one_shot_server(_chunked(*pieces, b"data: [DONE]\n\n"))
    async with server:
        assert await _collect(url) == ["a", "b", "c"]


async def test_raw_client_raises_on_broken_streams() -> None:
    error = b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n'
    cases = {
        "engine died": _chunked(_event("a"), error),
        "closed mid-stream": _chunked(_event("a"))[: -len(b"0\r\n\r\n")],
        "chunked event stream": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
        "not an HTTP response": b"SSH-2.0-OpenSSH\r\n\r\n",
    }
    for message, body in cases.items():
        server, url = await _one_shot_server(body)
        async with server:
            with pytest.raises(StreamError, match=message):
                await _collect(url)
