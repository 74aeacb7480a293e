"""The OpenAI endpoint on a bf16 engine with the native CPU kernels (engine/kernels): decode
steps through the fused kernel, image prompts through its flash attention, concurrent streams
batched. Skipped where the kernels cannot run (the engine then serves on the eager path)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from engine.kernels import load_cpu_decode
from vision_serve.settings import ServerSettings

from .support import ServerHandle, data_url, image_message, make_engine, make_image, start_server

pytestmark = pytest.mark.skipif(
    load_cpu_decode() is None, reason="needs AVX-512 or AVX2 and a C++ compiler"
)


@pytest.fixture(scope="module")
def native(checkpoint: Any) -> Iterator[ServerHandle]:
    engine = make_engine(str(checkpoint), dtype="bfloat16", num_threads=None)
    handle = start_server(engine, ServerSettings())
    yield handle
    handle.stop()
    engine.shutdown()


def _runner(handle: ServerHandle) -> Any:
    return handle.engine.engine.runner


def test_image_chat_streams_and_matches_the_non_streamed_answer(native: ServerHandle) -> None:
    assert _runner(native).fused_decoder is not None
    client = native.client()
    messages = image_message("What is in this picture?", data_url(make_image(140, 112)))
    params = {"model": native.model, "messages": messages, "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(**params, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens > 40  # the image's placeholder tokens are counted
    before = _runner(native).fused_decode_steps
    chunks = client.chat.completions.create(
        **params,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == whole.choices[0].message.content  # greedy, same path: same tokens
    assert usage is not None and usage.completion_tokens == 12
    assert _runner(native).fused_decode_steps > before  # decodes went through the kernel


async def test_concurrent_streams_decode_together(native: ServerHandle) -> None:
    client = native.async_client()

    async def one(i: int) -> int:
        out = await client.chat.completions.create(
            model=native.model,
            messages=[{"role": "user", "content": f"Tell me about camera {i}."}],
            max_tokens=16,
            extra_body={"ignore_eos": True},
        )
        return out.usage.completion_tokens

    assert await asyncio.gather(*(one(i) for i in range(6))) == [16] * 6
