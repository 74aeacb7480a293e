"""Many concurrent streaming clients, and the two priority classes sharing one engine."""

from __future__ import annotations

import asyncio
from typing import Any

from .support import data_url, image_message, make_image, wait_for

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8}


def _conversations() -> list[list[dict[str, Any]]]:
    """Eight distinct prompts: four text chats, four with (different) images."""
    texts = [[{"role": "user", "content": f"Tell me about camera {i}."}] for i in range(2)] + [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Who is at the door?"},
            {"role": "assistant", "content": "A person."},
            {"role": "user", "content": f"What are they holding, take {i}?"},
        ]
        for i in range(2)
    ]
    colors = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]
    images = [
        image_message(f"Describe frame {i}.", data_url(make_image(112, 84 + 28 * (i % 2), c)))
        for i, c in enumerate(colors)
    ]
    return texts + images


async def _stream_one(client: Any, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = [c async for c in stream]
    return {
        "role": chunks[0].choices[0].delta.role,
        "text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        "finish": [c.choices[0].finish_reason for c in chunks if c.choices][-1],
        "usage": chunks[-1].usage,
    }


async def test_sixteen_concurrent_streams_mixing_text_and_images(server, offline):
    from engine import SamplingParams

    conversations = _conversations()
    expected = offline.chat(conversations, SamplingParams(temperature=0, max_tokens=8))
    jobs = [conversations[i % len(conversations)] for i in range(16)]

    async with server.async_client() as client:
        results = await asyncio.gather(*(_stream_one(client, server.model, m) for m in jobs))

    for i, result in enumerate(results):
        ref = expected[i % len(conversations)]
        assert result["role"] == "assistant"
        assert result["text"] == ref.outputs[0].text, f"stream {i}"
        assert result["finish"] == ref.outputs[0].finish_reason
        assert result["usage"].prompt_tokens == len(ref.prompt_token_ids)
        assert result["usage"].completion_tokens == len(ref.outputs[0].token_ids)
    assert wait_for(lambda: server.engine.get_stats().num_running == 0)


async def test_batch_requests_do_not_delay_interactive_beyond_the_scheduler_contract(server):
    """Camera-like batch requests (several images: many prefill chunks each) are in flight when
    interactive chats arrive. From the engine's per-request timings: an interactive request is
    scheduled before any batch request that was still waiting, its prompt is prefilled in one
    chunk (no batch prefill took the budget first), and its queue time is a fraction of a batch
    request's prefill (it never waits out a batch prefill)."""
    big = [make_image(224, 224, (20 * i, 255 - 20 * i, 90)) for i in range(12)]
    batch_messages = [
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": f"Camera {k}: who is there?"}]
                + [{"type": "image_url", "image_url": {"url": data_url(img)}} for img in imgs],
            }
        ]
        for k, imgs in enumerate([big[0:3], big[3:6], big[6:9], big[9:12]])
    ]

    async with server.async_client() as client:

        async def batch(messages: list[dict[str, Any]]) -> str:
            resp = await client.chat.completions.create(
                model=server.model,
                messages=messages,
                max_tokens=4,
                temperature=0,
                extra_body={"priority": "batch"},
            )
            return resp.id.removeprefix("chatcmpl-")

        async def interactive() -> list[str]:
            """One chat after another (two arriving in the same step would share the
            interactive budget, FCFS, which is a different contract)."""
            ids = []
            for i in range(4):
                await asyncio.sleep(0.02)
                stream = await client.chat.completions.create(
                    model=server.model,
                    messages=[{"role": "user", "content": f"Hi {i}?"}],
                    stream=True,
                    max_tokens=4,
                    temperature=0,
                )
                chunks = [c async for c in stream]
                ids.append(chunks[0].id.removeprefix("chatcmpl-"))
            return ids

        *batch_ids, inter_ids = await asyncio.gather(
            *(batch(m) for m in batch_messages), interactive()
        )

    records = {r.id: r for r in server.app.state.metrics.recent}
    batch_recs = [records[i] for i in batch_ids]
    inter_recs = [records[i] for i in inter_ids]
    assert all(r.priority == "batch" for r in batch_recs)
    assert all(r.prefill_chunks >= 3 for r in batch_recs), "batch prompts should need chunks"

    budget = server.engine.args.max_num_batched_tokens
    overlapped = 0
    for ir in inter_recs:
        im = ir.engine_metrics
        arrival, scheduled = im.arrival_time, im.first_scheduled_time
        # Decodes (at most one per request in flight) come first, then interactive prefill:
        # a prompt that fits beside them goes in one chunk, whatever batch prefill is pending.
        assert ir.prompt_tokens + len(batch_recs) + 1 <= budget, "test precondition"
        assert ir.prefill_chunks == 1, ir.log_fields()
        for br in batch_recs:
            bm = br.engine_metrics
            # No batch request waiting at the interactive arrival was scheduled before it.
            assert not (arrival < bm.first_scheduled_time < scheduled), (ir.id, br.id)
            if bm.first_scheduled_time < arrival < bm.prefill_done_time:
                overlapped += 1
                # It did not wait out the running batch prefill.
                assert ir.queue_s < br.prefill_s / 2, (ir.log_fields(), br.log_fields())
    assert overlapped >= 1, "no interactive request arrived during a batch prefill"
