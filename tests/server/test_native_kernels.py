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


@pytest.fixture(scope="module")
def native_int8(checkpoint: Any) -> Iterator[ServerHandle]:
    engine = make_engine(str(checkpoint), dtype="bfloat16", num_threads=None, quantization="int8")
    handle = start_server(engine, ServerSettings())
    yield handle
    handle.stop()
    engine.shutdown()


async def test_int8_server_streams_image_and_text_chats_through_the_int8_kernel(
    native_int8: ServerHandle,
) -> None:
    """``--quantization int8`` behind the HTTP server: the decode steps run the fused kernel's
    int8 panels (int16 activations with VNNI, int8 on AVX2, widened elsewhere), image and text
    chats stream side by side to their full length, and a stream's text is the non-streamed
    answer's (run alone both times: batched prompt steps may take other prefill kernels, and
    a near-tie of this random checkpoint could then go either way)."""
    runner = _runner(native_int8)
    assert runner.fused_decoder is not None
    assert native_int8.engine.engine.model.decode_kernel_scales  # int8 weights in the kernel
    client = native_int8.async_client()
    image = data_url(make_image(140, 112))
    convs = [
        image_message("What is in this picture?", image),
        [{"role": "user", "content": "Describe a parking lot at night."}],
        [{"role": "user", "content": "Count the people at the gate."}],
    ]

    async def ask(messages: list, stream: bool) -> tuple[str, int]:
        params = {"model": native_int8.model, "messages": messages, "max_tokens": 10}
        extra = {"ignore_eos": True}
        if not stream:
            out = await client.chat.completions.create(**params, temperature=0, extra_body=extra)
            return out.choices[0].message.content, out.usage.completion_tokens
        chunks = await client.chat.completions.create(
            **params,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        text, tokens = "", 0
        async for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, tokens

    before = runner.fused_decode_steps
    together = await asyncio.gather(*(ask(c, stream=True) for c in convs))
    assert [tokens for _, tokens in together] == [10, 10, 10]
    assert all(text for text, _ in together)
    assert runner.fused_decode_steps > before
    for conv in convs[:2]:  # the image chat and a text one
        assert await ask(conv, stream=True) == await ask(conv, stream=False)
