"""Ultralytics' ``LLM`` interface (ultralytics >= 8.4.190: ``ultralytics/models/llm.py``, an
OpenAI-SDK wrapper) describes an image through our server with ``api="chat.completions"``."""

from __future__ import annotations

import pytest

from .support import API_KEY, make_image

ultralytics = pytest.importorskip("ultralytics")


def _llm(server):
    from ultralytics import LLM

    return LLM(
        server.model,
        api="chat.completions",
        base_url=server.v1,
        api_key=API_KEY,
        max_tokens=6,
        temperature=0,
    )


def test_ultralytics_llm_describes_an_image_file(server, tmp_path):
    path = tmp_path / "frame.jpg"
    make_image(160, 120).save(path)
    response = _llm(server)("Describe the people in this frame.", image=str(path))

    assert response.object == "chat.completion"
    assert response.model == server.model
    assert response.usage.prompt_tokens > 20  # the image's tokens are in the prompt
    assert 1 <= response.usage.completion_tokens <= 6
    assert isinstance(response.choices[0].message.content, str)


async def test_ultralytics_llm_async_call_with_a_pil_image(server):
    response = await _llm(server).async_call(make_image(112, 112))  # default prompt
    assert response.choices[0].finish_reason in ("stop", "length")
