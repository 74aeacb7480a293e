"""The async engine serves many coroutines at once and matches the offline engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import LLM, AsyncEngine, EngineArgs, SamplingParams
from engine.async_engine import BATCH_PREPROCESS_NICENESS
from engine.errors import InvalidImageError
from tests.engine.helpers import image_conv, noise_image, text_conv


@pytest.fixture(scope="module")
def async_engine(tiny_qwen2_vl):
    engine = AsyncEngine(
        EngineArgs(model=str(tiny_qwen2_vl), dtype="float32", max_num_batched_tokens=32)
    )
    yield engine
    engine.shutdown()


async def _collect(engine, rid, conv, params):
    stream = await engine.add_request(rid, conv, params)
    text, last = "", None
    async for out in stream:
        text += out.outputs[0].delta_text
        last = out
    return text, last


async def test_concurrent_requests_match_offline(async_engine, tiny_qwen2_vl):
    convs = [text_conv(f"question {i} about the lobby camera") for i in range(5)]
    convs.append(image_conv("describe", noise_image(112, 112, seed=3)))
    params = SamplingParams(temperature=0, max_tokens=12)
    results = await asyncio.gather(
        *(_collect(async_engine, f"r{i}", c, params) for i, c in enumerate(convs))
    )
    offline = LLM(str(tiny_qwen2_vl), dtype="float32").chat(convs, params)
    for (text, last), ref in zip(results, offline, strict=True):
        assert last.finished
        assert last.outputs[0].token_ids == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text
        assert last.metrics.first_token_time >= last.metrics.first_scheduled_time


async def test_bad_image_raises_before_streaming(async_engine):
    bad = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}}],
        }
    ]
    with pytest.raises(InvalidImageError):
        await async_engine.add_request("bad", bad, SamplingParams())
    assert async_engine.is_alive()


async def test_leaving_the_stream_early_aborts_and_frees_blocks(async_engine):
    stream = await async_engine.add_request(
        "long", text_conv("go on"), SamplingParams(max_tokens=500, ignore_eos=True)
    )
    aborted_before = async_engine.get_stats().num_aborted
    got = 0
    async for _ in stream:
        got += 1
        if got == 3:
            break
    for _ in range(100):
        stats = async_engine.get_stats()
        if stats.num_aborted > aborted_before and stats.num_running == 0:
            break
        await asyncio.sleep(0.05)
    stats = async_engine.get_stats()
    assert stats.num_aborted == aborted_before + 1
    assert stats.kv_blocks_used == 0


async def test_camera_frames_are_preprocessed_at_a_lower_cpu_priority(async_engine, monkeypatch):
    """Batch requests' images are decoded on threads that yield the cores to the step loop;
    interactive ones keep the normal priority (their preprocessing is part of a TTFT)."""
    import os
    import threading

    seen: dict[str, int] = {}
    prepare = async_engine._prepare

    def recording_prepare(inputs, params):
        seen[params.seed] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return prepare(inputs, params)

    monkeypatch.setattr(async_engine, "_prepare", recording_prepare)
    frame = image_conv("who is there?", noise_image(112, 112, seed=5))
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for seed, priority in ((1, "batch"), (2, "interactive")):
        params = SamplingParams(temperature=0, max_tokens=2, seed=seed)
        stream = await async_engine.add_request(f"nice-{seed}", frame, params, priority=priority)
        async for _ in stream:
            pass
    assert seen[1] == max(base, BATCH_PREPROCESS_NICENESS)
    assert seen[2] == base


async def test_a_step_wakes_each_event_loop_once(async_engine, monkeypatch):
    """Streams on one event loop get a step's outputs through one wake-up, not one each (the
    per-token CPU of the step thread and the front end), and each stream still gets all of
    its own tokens, in order."""
    loop = asyncio.get_running_loop()
    wakeups = 0
    schedule = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):
        nonlocal wakeups
        wakeups += 1
        return schedule(callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = await asyncio.gather(
        *(_collect(async_engine, f"wake-{i}", text_conv(f"camera {i}"), params) for i in range(4))
    )
    outputs = 0
    for _, last in results:
        assert last.finished and len(last.outputs[0].token_ids) == 16
        outputs += 16
    # 4 streams decode side by side for most of their 16 tokens: about one wake-up a step
    assert 0 < wakeups <= outputs // 2, (wakeups, outputs)


def test_a_stream_whose_event_loop_closed_is_dropped(async_engine):
    """A caller's event loop that is gone (a thread that made a request and ended) cannot take
    its outputs: the engine aborts that request, frees its blocks and keeps serving."""
    loop = asyncio.new_event_loop()
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    loop.run_until_complete(async_engine.add_request("orphan", text_conv("go on"), params))
    loop.close()

    def dropped() -> bool:  # the add may still be in the step thread's inbox at first
        stats = async_engine.get_stats()
        idle = (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
        return idle and "orphan" not in async_engine._streams

    deadline = time.monotonic() + 30
    while not dropped() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dropped() and async_engine.is_alive()
    ok = asyncio.run(_collect(async_engine, "after", text_conv("hi"), SamplingParams(max_tokens=3)))
    assert ok[1].finished
