"""Per-request ``mm_processor_kwargs`` (vLLM's extra body) through the real ``openai`` client.

The shared server runs the tiny checkpoint, which resizes a 640x480 frame to 252x168 px = 54
image tokens; capped at 112x112 px it becomes 112x84 px = 12 (one token per 28x28 px).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from .support import data_url, image_message, make_image, request_log

FRAME = image_message("Describe.", data_url(make_image(640, 480)))
SMALL = {"max_pixels": 112 * 112}


def _chat(client: openai.OpenAI, server: Any, **extra_body: Any) -> Any:
    return client.chat.completions.create(
        model=server.model,
        messages=FRAME,
        max_tokens=2,
        temperature=0,
        extra_body=extra_body or None,
    )


def test_max_pixels_cuts_the_prompt_by_the_image_tokens_saved(client, server, request_logs):
    full = _chat(client, server)
    small = _chat(client, server, mm_processor_kwargs=SMALL)
    assert full.usage.prompt_tokens - small.usage.prompt_tokens == 54 - 12
    # the request log line says how many of the prompt's tokens were the image's
    lines = request_log(request_logs)
    assert lines[full.id.removeprefix("chatcmpl-")]["image_tokens"] == 54
    assert lines[small.id.removeprefix("chatcmpl-")]["image_tokens"] == 12
    # the override was that request's only: the next plain request is full size again
    assert _chat(client, server).usage.prompt_tokens == full.usage.prompt_tokens


def test_streamed_request_and_completions_accept_it(client, server):
    stream = client.chat.completions.create(
        model=server.model,
        messages=FRAME,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"mm_processor_kwargs": SMALL},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage][-1]
    plain = _chat(client, server)
    assert plain.usage.prompt_tokens - usage.prompt_tokens == 54 - 12
    # text completions take the field too (vLLM does); a text prompt has no image to resize
    done = client.completions.create(
        model=server.model,
        prompt="Hello",
        max_tokens=2,
        extra_body={"mm_processor_kwargs": SMALL},
    )
    assert done.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("kwargs", "param", "says"),
    [
        ({"max_pixel": 12544}, "mm_processor_kwargs.max_pixel", "not permitted"),
        ({"size": {"longest_edge": 12544}}, "mm_processor_kwargs.size", "not permitted"),
        ({"max_pixels": -1}, "mm_processor_kwargs.max_pixels", "greater than 0"),
        ({"max_pixels": "12544"}, "mm_processor_kwargs.max_pixels", "valid integer"),
        ({"max_pixels": 1.5}, "mm_processor_kwargs.max_pixels", "valid integer"),
        ("max_pixels=12544", "mm_processor_kwargs", "valid dictionary"),
        ({"min_pixels": 20000, "max_pixels": 10000}, "mm_processor_kwargs", "min_pixels 20000"),
    ],
)
def test_bad_mm_processor_kwargs_are_a_400_in_openais_shape(client, server, kwargs, param, says):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, server, mm_processor_kwargs=kwargs)
    assert err.value.status_code == 400
    body = err.value.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param
    assert says in body["error"]["message"]
