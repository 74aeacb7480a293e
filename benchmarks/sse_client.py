"""A load generator's chat client that reads the server-sent events off the socket itself.

Why not the ``openai`` SDK here: the benchmarks run their client on the server's own cores (a
2-core machine has no others), and the SDK parses each event into pydantic objects over httpx:
~350 µs of CPU a streamed token, against ~110 for the server's whole front end (four chat
streams on a 2-core Zen 4 EPYC; per-thread CPU time from ``/proc``); httpx alone with one
``json.loads`` an event still took ~200. That CPU lands inside the engine's steps and is
charged to whatever runs in them: beside four such streams a camera frame's encoder piece
measured 56 µs a unit against 13 alone, while the chat's own forward in those steps ran
faster than alone. Clients of an edge server run elsewhere (a browser, the camera pipeline's
describer), so the benchmarks' default client is this one: one HTTP/1.1 connection a request
on asyncio streams, the chunked body split into events, one ``json.loads`` an event (vLLM's
serving benchmark reads the stream raw too, with aiohttp). ``--client openai`` keeps the SDK;
the tests use the SDK throughout (any OpenAI client must work unchanged).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class StreamError(RuntimeError):
    """The server answered with an error: an HTTP status, or an error event mid-stream."""


class RawChatClient:
    def __init__(self, base_url: str, api_key: str, timeout: float) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or url.hostname is None:
            raise ValueError(f"RawChatClient speaks plain http only, not {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.path = url.path.rstrip("/") + "/chat/completions"
        self.api_key, self.timeout = api_key, timeout

    async def content_events(
        self, model: str, messages: list[dict], max_tokens: int, extra: dict | None
    ) -> AsyncIterator[str]:
        """The streamed completion's non-empty content deltas, one per event."""
        body = json.dumps(
            {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                **(extra or {}),
            }
        ).encode()
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port), self.timeout
        )
        try:
            writer.write(
                (
                    f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                    f"Authorization: Bearer {self.api_key}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                ).encode()
                + body
            )
            status, headers = await asyncio.wait_for(_read_head(reader), self.timeout)
            if status != 200:
                raise StreamError(f"HTTP {status}: {(await reader.read(400))[:200]!r}")
            if headers.get("transfer-encoding", "").lower() != "chunked":
                raise StreamError(f"expected a chunked event stream, got headers {headers}")
            pending = b""
            while True:
                chunk = await asyncio.wait_for(_read_chunk(reader), self.timeout)
                if not chunk:
                    return
                # SSE lines may end in CRLF too, split across chunks at worst
                pending = (pending + chunk).replace(b"\r\n", b"\n")
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data:"):
                        continue
                    data = event[5:].lstrip(b" ")
                    if data == b"[DONE]":
                        return
                    parsed = json.loads(data)
                    if "error" in parsed:
                        raise StreamError(str(parsed["error"])[:200])
                    choices = parsed.get("choices")
                    if choices:
                        content = (choices[0].get("delta") or {}).get("content")
                        if content:
                            yield content
        finally:
            writer.close()

    async def close(self) -> None:
        """Nothing held between requests (a connection each)."""


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise StreamError(f"not an HTTP response: {status_line[:100]!r}")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _read_chunk(reader: asyncio.StreamReader) -> bytes:
    """One chunk of a chunked body; b"" at its end."""
    size_line = await reader.readline()
    if not size_line:
        raise StreamError("connection closed mid-stream")
    size = int(size_line.split(b";", 1)[0], 16)
    if size == 0:
        await reader.readline()  # the CRLF after the last chunk (no trailers from our server)
        return b""
    data = await reader.readexactly(size + 2)
    return data[:-2]
