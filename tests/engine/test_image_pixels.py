"""Image size bounds: ``--max-pixels`` / ``--min-pixels`` engine-wide, ``mm_processor_kwargs``
per request. Image tokens scale with pixels, so these are the cheapest lever on a frame's cost.

The tiny checkpoint resizes into [56x56, 224x224] pixels in steps of 28 px (14 px patches, 2x2
merge, one image token per 28x28 px):

- 640x480 -> 252x168 (the 224x224 cap) = 9x6 = 54 tokens; capped at 112x112 px -> 112x84 = 12;
- 28x28 -> 56x56 (the 56x56 floor) = 4 tokens; raised to 112x112 px -> 16.
"""

from __future__ import annotations

import argparse

import pytest

from engine import LLM, EngineArgs, SamplingParams
from engine.config import add_engine_cli_args, engine_args_from_namespace
from engine.errors import InvalidRequestError
from tests.engine.helpers import image_conv, noise_image

FRAME = noise_image(640, 480, seed=1)
TINY = noise_image(28, 28, seed=2)
SMALL = 112 * 112


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl) -> LLM:
    return LLM(str(tiny_qwen2_vl), dtype="float32", max_model_len=512)


def _image_tokens(llm: LLM, image, **mm_processor_kwargs: int) -> int:
    inputs = {"messages": image_conv("Describe.", image)}
    if mm_processor_kwargs:
        inputs["mm_processor_kwargs"] = mm_processor_kwargs
    return llm.engine.process_inputs(inputs).num_image_tokens


def test_checkpoint_bounds_by_default(llm: LLM) -> None:
    assert _image_tokens(llm, FRAME) == 54
    assert _image_tokens(llm, TINY) == 4


def test_request_max_pixels_lowers_a_frames_image_tokens(llm: LLM) -> None:
    assert _image_tokens(llm, FRAME, max_pixels=SMALL) == 12
    assert _image_tokens(llm, FRAME) == 54, "the override applied to that request only"


def test_request_min_pixels_raises_a_tiny_images_tokens(llm: LLM) -> None:
    assert _image_tokens(llm, TINY, min_pixels=SMALL) == 16


def test_chat_generates_with_the_smaller_image(llm: LLM) -> None:
    """The whole path (vision tower on the smaller grid, M-RoPE, KV) runs with the override."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    small, full = (
        llm.chat(image_conv("Describe.", FRAME), params, mm_processor_kwargs=kwargs)[0]
        for kwargs in ({"max_pixels": SMALL}, None)
    )
    assert small.num_image_tokens == 12 and full.num_image_tokens == 54
    assert len(full.prompt_token_ids) - len(small.prompt_token_ids) == 54 - 12
    assert len(small.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_pixel": 1000}, "unsupported key 'max_pixel'"),
        ({"max_pixels": 0}, "positive integer"),
        ({"max_pixels": "200704"}, "positive integer"),
        ({"max_pixels": True}, "positive integer"),
        ({"min_pixels": 20000, "max_pixels": 10000}, "min_pixels 20000 > max_pixels 10000"),
        ({"min_pixels": 10**6}, "min_pixels 1000000 > max_pixels 50176"),  # the engine's max
    ],
)
def test_bad_mm_processor_kwargs_are_refused(llm: LLM, kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        llm.chat(image_conv("Describe.", FRAME), mm_processor_kwargs=kwargs)


def test_engine_wide_bounds_replace_the_checkpoints(tiny_qwen2_vl) -> None:
    llm = LLM(
        str(tiny_qwen2_vl), dtype="float32", max_model_len=512, max_pixels=SMALL, min_pixels=SMALL
    )
    assert _image_tokens(llm, FRAME) == 12
    assert _image_tokens(llm, TINY) == 16
    # a request can still ask for other bounds than the engine's
    assert _image_tokens(llm, TINY, min_pixels=56 * 56) == 4


def test_engine_args_validate_and_parse_the_bounds() -> None:
    with pytest.raises(ValueError, match="max_pixels must be >= 1"):
        EngineArgs(model="m", max_pixels=0)
    with pytest.raises(ValueError, match="min_pixels must be <= max_pixels"):
        EngineArgs(model="m", min_pixels=2000, max_pixels=1000)
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    ns = parser.parse_args(["--model", "m", "--max-pixels", "200704", "--min-pixels", "3136"])
    args = engine_args_from_namespace(ns)
    assert (args.max_pixels, args.min_pixels) == (200704, 3136)
    assert engine_args_from_namespace(parser.parse_args(["--model", "m"])).max_pixels is None
