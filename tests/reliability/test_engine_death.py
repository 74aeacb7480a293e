"""If the step loop dies anyway, nothing waits forever: open streams, requests being
preprocessed and later requests all get 503 ``engine_dead``, ``/health`` turns 503, and
``vision-serve serve`` exits non-zero so that its supervisor restarts it."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.reliability.faulty_serve import STEP_FAULT_MARKER
from tests.server.support import (
    ServerHandle,
    make_engine,
    start_server,
    wait_for,
    wait_until_healthy,
)
from vision_serve.settings import ServerSettings

REPO_ROOT = Path(__file__).resolve().parents[2]
OK_MESSAGES = [{"role": "user", "content": "Hello there."}]
KILLER_MESSAGES = [{"role": "user", "content": f"Hello {STEP_FAULT_MARKER}"}]
SLOW_PREPROCESS_MARKER = "<<preprocess-slowly>>"


@pytest.fixture
def doomed(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerHandle]:
    """A server of its own whose engine's step raises once a marked request is scheduled."""
    engine = make_engine(str(checkpoint), preprocess_workers=4)
    llm_engine = engine.engine
    original = llm_engine.step

    def step() -> list[Any]:
        for req in llm_engine.scheduler.requests.values():
            if STEP_FAULT_MARKER in (req.prompt.prompt or ""):
                raise RuntimeError("injected fault in the engine step")
        return original()

    monkeypatch.setattr(llm_engine, "step", step)
    handle = start_server(engine, ServerSettings())
    yield handle
    handle.stop()
    engine.shutdown()


def _assert_engine_dead(exc: openai.APIStatusError) -> None:
    assert exc.status_code == 503
    assert exc.code == "engine_dead"
    assert set(exc.response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.timeout(120)
async def test_loop_death_fails_every_request_with_503_and_never_hangs(doomed: ServerHandle):
    engine = doomed.engine
    died = threading.Event()
    engine.add_death_callback(lambda exc: died.set())

    # A request whose preprocessing is still running when the loop dies: before the fix it
    # registered its stream after the death sweep and waited forever.
    original_process = engine.engine.process_inputs
    in_preprocess = threading.Event()

    def slow_process(inputs: Any) -> Any:
        if SLOW_PREPROCESS_MARKER in str(inputs):
            in_preprocess.set()
            assert died.wait(timeout=60)
        return original_process(inputs)

    engine.engine.process_inputs = slow_process
    assert httpx.get(doomed.base_url + "/health/ready").status_code == 200

    async with doomed.async_client(timeout=30) as client:
        streaming = await client.chat.completions.create(
            model=doomed.model,
            messages=OK_MESSAGES,
            max_tokens=500,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        await streaming.__anext__()  # in the engine and running
        in_flight = asyncio.ensure_future(
            client.chat.completions.create(
                model=doomed.model,
                messages=[{"role": "user", "content": f"Hi {SLOW_PREPROCESS_MARKER}"}],
                max_tokens=2,
            )
        )
        assert await asyncio.to_thread(in_preprocess.wait, 30)

        with pytest.raises(openai.InternalServerError) as killer:
            await client.chat.completions.create(
                model=doomed.model, messages=KILLER_MESSAGES, max_tokens=2
            )
        _assert_engine_dead(killer.value)
        assert died.is_set()

        with pytest.raises(openai.APIError) as stream_exc:
            async for _ in streaming:
                pass
        assert stream_exc.value.code == "engine_dead"

        with pytest.raises(openai.InternalServerError) as preprocessing:
            await asyncio.wait_for(in_flight, timeout=30)
        _assert_engine_dead(preprocessing.value)

        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as later:
            await client.chat.completions.create(
                model=doomed.model, messages=OK_MESSAGES, max_tokens=2
            )
        _assert_engine_dead(later.value)
        assert time.monotonic() - t0 < 10  # refused at once, not after a timeout

    for path in ("/health", "/health/ready"):
        resp = httpx.get(doomed.base_url + path)
        assert resp.status_code == 503, path
        assert resp.json()["error"]["code"] == "engine_dead"
    assert not engine.is_alive()
    assert not engine._streams


@pytest.mark.timeout(120)
async def test_readiness_follows_the_queue_and_liveness_does_not(checkpoint: Path):
    engine = make_engine(str(checkpoint), max_num_seqs=1, max_queue_len=1)
    handle = start_server(engine, ServerSettings())
    ready_url, live_url = handle.base_url + "/health/ready", handle.base_url + "/health"
    try:
        assert httpx.get(ready_url).json() == {"status": "ready"}
        async with handle.async_client() as client:
            streams = []
            for _ in range(2):  # one runs (the only sequence slot), one waits: queue full
                stream = await client.chat.completions.create(
                    model=handle.model,
                    messages=OK_MESSAGES,
                    max_tokens=900,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                await stream.__anext__()
                streams.append(stream)
            assert wait_for(lambda: httpx.get(ready_url).status_code == 503)
            assert httpx.get(ready_url).json()["error"]["code"] == "queue_full"
            assert httpx.get(live_url).json() == {"status": "ok"}
            for stream in streams:
                await stream.close()
        assert wait_for(lambda: httpx.get(ready_url).status_code == 200)
    finally:
        handle.stop()
        engine.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_serve_process_exits_non_zero_when_the_engine_loop_dies(checkpoint: Path, tmp_path):
    port = _free_port()
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.faulty_serve", "serve",
             "--model", str(checkpoint), "--port", str(port), "--dtype", "float32",
             "--device", "cpu", "--num-threads", "1", "--served-model-name", "tiny",
             "--graceful-shutdown-s", "2"],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base, log_path, timeout_s=120)

        with openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30) as c:
            ok = c.chat.completions.create(model="tiny", messages=OK_MESSAGES, max_tokens=3)
            assert ok.choices[0].finish_reason in ("stop", "length")
            streaming = c.chat.completions.create(
                model="tiny",
                messages=OK_MESSAGES,
                max_tokens=500,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            next(iter(streaming))  # running when the loop dies
            with pytest.raises(openai.InternalServerError) as killer:
                c.chat.completions.create(model="tiny", messages=KILLER_MESSAGES, max_tokens=2)
            _assert_engine_dead(killer.value)
            with pytest.raises(openai.APIError) as stream_exc:
                for _ in streaming:
                    pass
            assert stream_exc.value.code == "engine_dead"
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    output = log_path.read_text()
    assert rc == 1, output
    assert "engine step loop died" in output
    assert "injected fault in the engine step" in output
    with pytest.raises(httpx.ConnectError):  # gone, for the supervisor to restart
        httpx.get(base + "/health", timeout=2)
