"""A server whose engine runs one sequence at a time with a one-request waiting queue: queue
full (429), deadlines of either priority (expired), and a stopped engine (503 + unhealthy
/health)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from vision_serve.errors import EXPIRED_STATUS
from vision_serve.settings import ServerSettings

from .support import (
    ServerHandle,
    data_url,
    engine_is_idle,
    image_message,
    make_engine,
    make_image,
    request_log,
    start_server,
    wait_for,
)

MESSAGES = [{"role": "user", "content": "Hello there."}]


@pytest.fixture(scope="module")
def limited(checkpoint: Any) -> Iterator[ServerHandle]:
    engine = make_engine(str(checkpoint), max_num_seqs=1, max_queue_len=1)
    handle = start_server(engine, ServerSettings())
    yield handle
    handle.stop()
    engine.shutdown()


async def _occupy(client: openai.AsyncOpenAI, server: ServerHandle) -> Any:
    """Start a long streaming request and return its open stream once it holds the only
    running slot and nothing waits (an earlier test's occupant may still be being aborted)."""
    engine = server.engine
    assert await asyncio.to_thread(wait_for, lambda: engine_is_idle(server), 30)
    stream = await client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        stream=True,
        max_tokens=900,
        extra_body={"ignore_eos": True},
    )
    await stream.__anext__()  # role chunk: the request was queued
    stats = engine.get_stats
    assert await asyncio.to_thread(
        wait_for, lambda: stats().num_running == 1 and stats().num_waiting == 0
    )
    return stream


async def test_full_queue_is_429_queue_full(limited):
    engine = limited.engine
    async with limited.async_client() as client:
        running = await _occupy(client, limited)
        waiting = asyncio.create_task(
            client.chat.completions.create(model=limited.model, messages=MESSAGES, max_tokens=2)
        )
        assert await asyncio.to_thread(wait_for, lambda: engine.get_stats().num_waiting == 1)

        with pytest.raises(openai.RateLimitError) as exc:
            await client.chat.completions.create(
                model=limited.model, messages=MESSAGES, max_tokens=2
            )
        assert exc.value.status_code == 429
        assert exc.value.code == "queue_full"
        assert exc.value.response.headers.get("retry-after")

        # admission comes before work: a refused image request was never decoded
        decoded = []
        real = engine.engine.process_inputs
        engine.engine.process_inputs = lambda inputs: decoded.append(1) or real(inputs)
        try:
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(
                    model=limited.model,
                    messages=image_message("Who is there?", data_url(make_image())),
                    max_tokens=2,
                )
        finally:
            engine.engine.process_inputs = real
        assert decoded == []

        await running.close()  # frees the only sequence slot: the waiting request runs
        resp = await asyncio.wait_for(waiting, timeout=30)
        assert resp.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("priority", ["batch", "interactive"])
async def test_request_past_its_deadline_expires(limited, request_logs, priority):
    """Camera frames use deadlines to skip stale work; a chat client may too (it would rather
    be told at once than answered late)."""
    engine = limited.engine
    expired_before = engine.get_stats().num_expired
    async with limited.async_client() as client:
        running = await _occupy(client, limited)

        with pytest.raises(openai.APIStatusError) as exc:
            await client.chat.completions.create(
                model=limited.model,
                messages=MESSAGES,
                max_tokens=2,
                extra_body={"priority": priority, "max_queue_seconds": 0.05},
            )
        assert exc.value.status_code == EXPIRED_STATUS
        assert exc.value.code == "expired"
        assert exc.value.response.headers["x-should-retry"] == "false"
        request_id = exc.value.response.headers["x-request-id"]

        # Streaming: the stream has started (200), so the expiry arrives as an error event,
        # which the SDK raises as an APIError carrying the same code.
        stream = await client.chat.completions.create(
            model=limited.model,
            messages=MESSAGES,
            max_tokens=2,
            stream=True,
            extra_body={"priority": priority, "max_queue_seconds": 0.05},
        )
        with pytest.raises(openai.APIError) as stream_exc:
            async for _ in stream:
                pass
        assert stream_exc.value.code == "expired"
        await running.close()

    assert wait_for(lambda: engine.get_stats().num_expired == expired_before + 2)
    metrics = httpx.get(limited.base_url + "/metrics").text
    assert f"vision_serve_requests_expired_total {float(expired_before + 2)}" in metrics
    assert (
        f'vision_serve_requests_total{{finish_reason="expired",priority="{priority}"}}' in metrics
    )
    lines = [f for f in request_log(request_logs).values() if f.get("finish_reason") == "expired"]
    assert len(lines) == 2
    assert all(f["status"] == EXPIRED_STATUS and f["output_tokens"] == 0 for f in lines)
    assert any(f["id"] == request_id for f in lines)


def test_stopped_engine_is_unhealthy_and_refuses_with_503(limited):
    """Runs last in this module: it stops the module's engine."""
    limited.engine.shutdown()
    health = httpx.get(limited.base_url + "/health")
    assert health.status_code == 503
    assert health.json()["error"]["code"] == "engine_dead"
    with limited.client() as client, pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model=limited.model, messages=MESSAGES, max_tokens=2)
    assert exc.value.status_code == 503
    assert exc.value.code == "engine_dead"


def test_the_waiting_queue_is_bounded_by_default():
    from engine import EngineArgs

    assert 0 < EngineArgs(model="m").max_queue_len <= 1024
