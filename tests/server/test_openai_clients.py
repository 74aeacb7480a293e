"""The official ``openai`` SDK, sync and async, streaming and not, talks to our server
unchanged, and greedy answers equal the offline engine's for the same request."""

from __future__ import annotations

from typing import Any

import pytest

from .support import data_url, image_message, make_image

TEXT_MESSAGES = [
    {"role": "system", "content": "You describe scenes."},
    {"role": "user", "content": "What is in the room?"},
]
IMAGE_MESSAGES = image_message("Describe the image.", data_url(make_image()))
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8}


def offline_chat(llm: Any, messages: list[dict[str, Any]], max_tokens: int = 8) -> Any:
    from engine import SamplingParams

    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens))[0]


@pytest.mark.parametrize("messages", [TEXT_MESSAGES, IMAGE_MESSAGES], ids=["text", "image"])
def test_sync_non_streaming_greedy_matches_offline_engine(client, server, offline, messages):
    resp = client.chat.completions.create(model=server.model, messages=messages, **GREEDY)
    expected = offline_chat(offline, messages)

    choice = resp.choices[0]
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.model == server.model
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


@pytest.mark.parametrize("messages", [TEXT_MESSAGES, IMAGE_MESSAGES], ids=["text", "image"])
async def test_async_streaming_greedy_matches_offline_engine(
    async_client, server, offline, messages
):
    stream = await async_client.chat.completions.create(
        model=server.model,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = [chunk async for chunk in stream]
    expected = offline_chat(offline, messages)

    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [expected.outputs[0].finish_reason]
    # include_usage: a last chunk with no choices carries the usage; the others carry null.
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert all(c.usage is None for c in chunks[:-1])


async def test_async_non_streaming_image(async_client, server):
    resp = await async_client.chat.completions.create(
        model=server.model, messages=IMAGE_MESSAGES, max_completion_tokens=4, temperature=0
    )
    assert resp.usage.completion_tokens <= 4
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_sync_streaming_without_usage_has_no_usage_field(client, server):
    with client.chat.completions.create(
        model=server.model, messages=TEXT_MESSAGES, stream=True, **GREEDY
    ) as stream:
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in chunks)


def test_png_and_webp_images_are_accepted(client, server):
    for fmt in ("PNG", "WEBP"):
        messages = image_message("Describe.", data_url(make_image(), fmt))
        resp = client.chat.completions.create(model=server.model, messages=messages, **GREEDY)
        text_only = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Describe."}], **GREEDY
        )
        # a 112x112 image is 4x4 merged patches = 16 placeholder tokens plus its two markers
        assert resp.usage.prompt_tokens - text_only.usage.prompt_tokens == 16 + 2


def test_file_url_under_allowed_path_is_accepted(client, server, media_dir):
    messages = image_message("Describe.", (media_dir / "red.png").as_uri())
    resp = client.chat.completions.create(model=server.model, messages=messages, **GREEDY)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_max_tokens_ends_with_length(client, server):
    resp = client.chat.completions.create(
        model=server.model,
        messages=TEXT_MESSAGES,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage.completion_tokens == 3
    assert resp.choices[0].finish_reason == "length"


def test_min_tokens_and_ignore_eos_are_honoured(client, server):
    resp = client.chat.completions.create(
        model=server.model,
        messages=TEXT_MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"min_tokens": 12, "ignore_eos": True, "top_k": 5},
    )
    assert resp.usage.completion_tokens == 12


def test_stop_string_ends_with_stop(client, server, offline):
    full = offline_chat(offline, TEXT_MESSAGES, max_tokens=12).outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("greedy text has no usable stop string")
    resp = client.chat.completions.create(
        model=server.model, messages=TEXT_MESSAGES, max_tokens=12, temperature=0, stop=[stop]
    )
    assert resp.choices[0].finish_reason == "stop"
    assert stop not in resp.choices[0].message.content
    assert full.startswith(resp.choices[0].message.content)


def test_seeded_sampling_is_the_engines_and_honours_temperature(client, server, offline):
    """The seeded answer is the offline engine's for the same seed and temperature (a server
    that dropped ``seed``, ``temperature`` or ``top_p`` would not reproduce it), and differs
    from the greedy one."""
    from engine import SamplingParams

    kwargs = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 8, "user": "u1"}
    a = client.chat.completions.create(model=server.model, messages=TEXT_MESSAGES, **kwargs)
    expected = offline.chat(
        TEXT_MESSAGES, SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8)
    )[0].outputs[0]
    assert a.choices[0].message.content == expected.text
    greedy = offline_chat(offline, TEXT_MESSAGES).outputs[0]
    assert expected.token_ids != greedy.token_ids[: len(expected.token_ids)]
    other_seed = offline.chat(
        TEXT_MESSAGES, SamplingParams(temperature=1.0, top_p=0.9, seed=1235, max_tokens=8)
    )[0].outputs[0]
    assert other_seed.token_ids != expected.token_ids


def test_text_completions_sync_and_stream(client, server):
    resp = client.completions.create(
        model=server.model, prompt="The camera sees", max_tokens=5, temperature=0
    )
    assert resp.object == "text_completion"
    assert resp.id.startswith("cmpl-")
    assert resp.usage.completion_tokens <= 5
    stream = client.completions.create(
        model=server.model, prompt="The camera sees", max_tokens=5, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in stream)
    assert streamed == resp.choices[0].text


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].object == "model"
