"""A fault while the engine loop handles one request fails that request only; the loop goes on
serving everyone else."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

import engine.llm_engine as llm_engine_module
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.server.support import engine_is_idle, wait_for

pytestmark = pytest.mark.timeout(120)

FAULT_MARKER = "<<fail-this-request>>"
OK_MESSAGES = [{"role": "user", "content": "Hello there."}]
FAULTY_MESSAGES = [{"role": "user", "content": f"Hello {FAULT_MARKER}"}]


class _FaultyRequest(Request):
    """Raises while the step thread admits a request carrying the marker, as building its
    seeded generator did for an out-of-range seed."""

    def __init__(self, request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> None:
        if FAULT_MARKER in (prompt.prompt or ""):
            raise RuntimeError("injected fault while admitting one request")
        super().__init__(request_id, prompt, *args, **kwargs)


@pytest.fixture
def faulty_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm_engine_module, "Request", _FaultyRequest)


def test_fault_for_one_request_fails_it_and_the_next_succeeds(healthy, faulty_admission):
    with healthy.http() as http:
        resp = http.post(
            "/v1/chat/completions",
            json={"model": healthy.model, "messages": FAULTY_MESSAGES, "max_tokens": 2},
        )
    assert resp.status_code == 500, resp.text
    assert resp.json() == {
        "error": {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }

    with healthy.client() as client:
        with pytest.raises(openai.InternalServerError) as exc:
            client.chat.completions.create(
                model=healthy.model, messages=FAULTY_MESSAGES, max_tokens=2
            )
        assert exc.value.code == "internal_error"

        # streaming: the stream has begun (200), the failure arrives as an error event
        stream = client.chat.completions.create(
            model=healthy.model, messages=FAULTY_MESSAGES, max_tokens=2, stream=True
        )
        with pytest.raises(openai.APIError) as stream_exc:
            for _ in stream:
                pass
        assert stream_exc.value.code == "internal_error"

        ok = client.chat.completions.create(model=healthy.model, messages=OK_MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert ok.usage.completion_tokens >= 1
    assert healthy.engine.is_alive()
    assert httpx.get(healthy.base_url + "/health").status_code == 200
    assert wait_for(lambda: engine_is_idle(healthy)), "the failed requests left state behind"


async def test_fault_does_not_disturb_requests_already_running(healthy, faulty_admission):
    async with healthy.async_client() as client:
        running = await client.chat.completions.create(
            model=healthy.model,
            messages=OK_MESSAGES,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = [await running.__anext__()]
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(
                model=healthy.model, messages=FAULTY_MESSAGES, max_tokens=2
            )
        async for chunk in running:
            chunks.append(chunk)
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text  # the running request got its whole answer


def test_a_caller_whose_event_loop_closed_does_not_kill_the_loop(healthy):
    """Handing an output to a stream whose event loop is gone raises on the step thread;
    that drops the one request (and frees its blocks) instead of killing the loop."""
    engine = healthy.engine
    loop = asyncio.new_event_loop()
    loop.run_until_complete(
        engine.add_request(
            "orphan",
            OK_MESSAGES,
            SamplingParams(max_tokens=200, ignore_eos=True),
        )
    )
    loop.close()
    assert wait_for(lambda: "orphan" not in engine._streams, timeout=30)
    assert wait_for(lambda: engine_is_idle(healthy), timeout=30)
    assert engine.is_alive()

    with healthy.client() as client:
        resp = client.chat.completions.create(
            model=healthy.model, messages=OK_MESSAGES, max_tokens=3
        )
    assert resp.choices[0].finish_reason in ("stop", "length")
