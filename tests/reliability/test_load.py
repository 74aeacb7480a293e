"""64 concurrent clients for a bounded time, through the real OpenAI SDK over loopback: text and
image prompts, streamed and not, interactive and batch, a fifth of them hanging up mid-answer.

Must hold: no 5xx; every answer that finished is well-formed (one finish reason, usage that
adds up, ``length`` exactly at ``max_tokens``); afterwards nothing is left behind (no request
waiting or running, no KV block, no pinned image embedding or half-done encoding job, no
output stream or detokenizer).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.support import (
    ServerHandle,
    data_url,
    engine_is_idle,
    image_message,
    make_engine,
    make_image,
    start_server,
    wait_for,
)
from vision_serve.settings import ServerSettings

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    # a client that gives up by timeout leaves httpx's response iterator to the garbage
    # collector, which reports it; that is the client library's clean-up, not the server's
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

CLIENTS = 64
DURATION_S = float(os.environ.get("LOAD_SECONDS", "30"))
HANGUP_SHARE = 0.2
IMAGES = [
    data_url(make_image(w, h, c)) for w, h, c in [(112, 84, (200, 30, 30)), (56, 112, (0, 90, 10))]
]


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> Iterator[ServerHandle]:
    engine = make_engine(str(checkpoint))
    handle = start_server(engine, ServerSettings())
    yield handle
    handle.stop()
    engine.shutdown()


def _messages(rng: random.Random) -> list[dict[str, Any]]:
    if rng.random() < 0.35:
        return image_message("Who is in this frame?", rng.choice(IMAGES))
    words = rng.choices(
        ["camera", "door", "person", "walks", "the", "red", "car"], k=rng.randint(3, 40)
    )
    return [{"role": "user", "content": " ".join(words)}]


async def _one(client: openai.AsyncOpenAI, model: str, rng: random.Random, tally: Counter) -> None:
    max_tokens = rng.randint(1, 40)
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": _messages(rng),
        "max_tokens": max_tokens,
        "temperature": rng.choice([0.0, 0.8]),
        "extra_body": {"priority": rng.choice(["interactive", "batch"]), "ignore_eos": True},
    }
    hang_up = rng.random() < HANGUP_SHARE
    if rng.random() < 0.7:
        stream = await client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        finish, usage, chunks = [], None, 0
        async for chunk in stream:
            chunks += 1
            if hang_up and chunks >= 2:
                break  # leave the loop first: closing a stream mid-iteration upsets httpx
            if chunk.usage is not None:
                usage = chunk.usage
            finish += [c.finish_reason for c in chunk.choices if c.finish_reason]
        if hang_up and chunks >= 2:
            await stream.close()
            tally["hung_up"] += 1
            return
        assert finish == ["length"], finish  # ignore_eos: every answer runs to max_tokens
        assert usage is not None and usage.completion_tokens == max_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        tally["streamed"] += 1
        return
    if hang_up:  # a non-streaming caller that gives up: the SDK closes the connection
        try:
            await client.with_options(timeout=0.05).chat.completions.create(**kwargs)
        except openai.APITimeoutError:
            tally["hung_up"] += 1
            return
    resp = await client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    assert resp.usage.completion_tokens == max_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    tally["complete"] += 1


async def _client_loop(server: ServerHandle, seed: int, until: float, tally: Counter) -> None:
    rng = random.Random(seed)
    async with server.async_client(timeout=120) as client:
        while time.monotonic() < until:
            try:
                await _one(client, server.model, rng, tally)
            except openai.APIStatusError as exc:
                tally[f"http_{exc.status_code}"] += 1
                assert exc.status_code < 500, exc


async def test_64_clients_with_hangups_get_no_5xx_and_leave_nothing_behind(loaded: ServerHandle):
    tally: Counter[str] = Counter()
    until = time.monotonic() + DURATION_S
    await asyncio.gather(*(_client_loop(loaded, seed, until, tally) for seed in range(CLIENTS)))
    print(f"load: {CLIENTS} clients, {DURATION_S:.0f}s: {dict(tally)}")
    served = tally["streamed"] + tally["complete"]
    assert served >= CLIENTS, tally
    assert tally["hung_up"] > 0, tally
    assert not [k for k in tally if k.startswith("http_5")], tally

    assert await asyncio.to_thread(wait_for, lambda: engine_is_idle(loaded), 30)
    inner = loaded.engine.engine
    cache = inner.encoder_cache
    assert all(not users for users in cache.refs.values()), "an image embedding is still pinned"
    runner = inner.runner
    assert not runner.encode_jobs, "a half-done encoding job outlived its requests"
    assert loaded.engine.is_alive()
