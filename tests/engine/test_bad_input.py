"""Bad input raises a clear exception and disturbs nothing else."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import (
    EmptyPromptError,
    InvalidImageError,
    InvalidRequestError,
    PromptTooLongError,
)
from tests.engine.helpers import text_conv


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(str(tiny_qwen2_vl), dtype="float32", max_model_len=256)


def test_prompt_longer_than_context(llm):
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        llm.chat(text_conv("word " * 400))


def test_unreadable_image(llm):
    bad = [
        {
            "role": "user",
            "content": [
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"},
                }
            ],
        }
    ]
    with pytest.raises(InvalidImageError, match="cannot decode"):
        llm.chat(bad)
    missing = [{"role": "user", "content": [{"type": "image", "image": "/no/such/frame.jpg"}]}]
    with pytest.raises(InvalidImageError, match="not found"):
        llm.chat(missing)


def test_empty_prompt(llm):
    with pytest.raises(EmptyPromptError):
        llm.generate("")


def test_invalid_sampling_params():
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_bad_request_in_a_batch_schedules_nothing_and_engine_keeps_serving(llm):
    good = text_conv("hello camera")
    with pytest.raises(PromptTooLongError):
        llm.chat([good, text_conv("word " * 400)])
    assert not llm.engine.has_unfinished()
    out = llm.chat(good, SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(out.outputs[0].token_ids) >= 1


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    import json

    from engine.errors import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="Qwen2VLForConditionalGeneration"):
        LLM(str(tmp_path))
