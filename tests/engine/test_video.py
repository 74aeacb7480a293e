"""Video input (a clip of frames) for Qwen2-VL / Qwen2.5-VL: parity with ``transformers``.

A clip is what a describer sends for a person's last few frames: the video processor pairs
frames into temporal patches, the same vision tower encodes them, and M-RoPE spaces the
patches over time (Qwen2.5-VL by seconds). Greedy tokens must equal ``transformers``
``generate()`` on the same prompt (fp32), and chunked prefill must equal one-shot.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidImageError, InvalidRequestError
from tests.engine.helpers import _hf, noise_image, truncate_at_eos

MAX_NEW = 16


@pytest.fixture(scope="module")
def engines():
    cache: dict = {}

    def get(path, **kwargs):
        key = (path, tuple(sorted(kwargs.items())))
        if key not in cache:
            kwargs.setdefault("max_num_batched_tokens", 2048)
            cache[key] = LLM(str(path), dtype="float32", **kwargs)
        return cache[key]

    return get


def clip(n: int, seed: int, width: int = 112, height: int = 84) -> list:
    return [noise_image(width, height, seed=seed + k) for k in range(n)]


def video_conv(text: str, frames: list, fps: float | None = None) -> list[dict]:
    part: dict = {"type": "video", "video": frames}
    if fps is not None:
        part["fps"] = fps
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def hf_video_greedy(checkpoint, frames: list, text: str, fps: float | None = None) -> list[int]:
    """``transformers`` on the same clip, built the way its docs show (no engine code)."""
    from transformers.video_utils import VideoMetadata

    processor, model = _hf(str(checkpoint))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs = {}
    if fps is not None:
        kwargs["video_metadata"] = [VideoMetadata(total_num_frames=len(frames), fps=fps)]
    enc = processor(text=[prompt], videos=[frames], return_tensors="pt", **kwargs)
    enc = enc.to(model.device)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, enc["input_ids"].shape[1] :].tolist()


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def test_four_frame_clip_matches_transformers(engines, tiny_checkpoint):
    llm = engines(tiny_checkpoint)
    frames = clip(4, seed=40)
    out = llm.chat(video_conv("Who walks past?", frames), _greedy())[0]
    ref = hf_video_greedy(tiny_checkpoint, frames, "Who walks past?")
    assert out.outputs[0].token_ids == truncate_at_eos(ref, llm.engine.eos_token_ids)


def test_clip_with_sampled_fps_matches_transformers(engines, tiny_checkpoint):
    """The rate sets Qwen2.5-VL's temporal positions (2 fps: one second per temporal patch)."""
    llm = engines(tiny_checkpoint)
    frames = clip(6, seed=50)
    out = llm.chat(video_conv("What changed?", frames, fps=2.0), _greedy())[0]
    ref = hf_video_greedy(tiny_checkpoint, frames, "What changed?", fps=2.0)
    assert out.outputs[0].token_ids == truncate_at_eos(ref, llm.engine.eos_token_ids)


@pytest.mark.parametrize("fps", [None, 2.0, 3.0])
def test_positions_equal_transformers_rope_index(engines, tiny_checkpoint, fps):
    """M-RoPE over time, checked directly: ``get_rope_index`` on the same tokens."""
    from transformers.video_utils import VideoMetadata

    llm = engines(tiny_checkpoint)
    frames = clip(6, seed=55)
    conv = video_conv("Where did they go?", frames, fps=fps)
    ours = llm.engine.processor.process(conv)
    processor, model = _hf(str(tiny_checkpoint))
    content = [{"type": "video"}, {"type": "text", "text": "Where did they go?"}]
    messages = [{"role": "user", "content": content}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs = {}
    if fps is not None:
        kwargs["video_metadata"] = [VideoMetadata(total_num_frames=len(frames), fps=fps)]
    enc = processor(text=[prompt], videos=[frames], return_tensors="pt", **kwargs)
    rope_kwargs = {k: enc[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in enc}
    positions, delta = model.model.get_rope_index(
        enc["input_ids"], enc["mm_token_type_ids"], **rope_kwargs
    )
    assert ours.token_ids == enc["input_ids"][0].tolist()
    assert torch.equal(ours.positions, positions[:, 0].cpu())
    assert ours.mrope_delta == int(delta[0, 0])


def test_odd_frame_count_repeats_the_last_frame(engines, tiny_qwen2_vl):
    llm = engines(tiny_qwen2_vl)
    processor = llm.engine.processor
    odd = processor.process(video_conv("x", clip(3, seed=60)))
    padded = processor.process(video_conv("x", [*clip(3, seed=60), clip(3, seed=60)[-1]]))
    (item,) = odd.images
    assert item.kind == "video" and item.grid_thw[0] == 2
    assert torch.equal(item.pixel_values, padded.images[0].pixel_values)
    assert odd.token_ids == padded.token_ids


def test_clip_tokens_follow_the_grid(engines, tiny_qwen2_vl):
    llm = engines(tiny_qwen2_vl)
    prompt = llm.engine.processor.process(video_conv("x", clip(4, seed=70)))
    (item,) = prompt.images
    t, h, w = item.grid_thw
    assert (t, h, w) == (2, 84 // 14, 112 // 14)  # 4 frames, temporal patch 2; 84x112 fits
    assert item.num_tokens == t * h * w // 4
    video_pad = llm.engine.processor.video_token_id
    assert prompt.token_ids.count(video_pad) == item.num_tokens


def test_chunked_prefill_equals_one_shot(engines, tiny_qwen2_vl):
    frames = clip(4, seed=80)
    conv = video_conv("Describe the clip.", frames)
    one_shot = engines(tiny_qwen2_vl).chat(conv, _greedy())[0]
    chunked_llm = engines(tiny_qwen2_vl, max_num_batched_tokens=16)
    chunked = chunked_llm.chat(conv, _greedy())[0]
    assert chunked.outputs[0].token_ids == one_shot.outputs[0].token_ids
    assert chunked.metrics.num_prefill_chunks > 1


def test_image_and_clip_in_one_prompt_match_transformers(engines, tiny_qwen2_vl):
    llm = engines(tiny_qwen2_vl)
    image, frames = noise_image(84, 84, seed=90), clip(2, seed=91)
    conv = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "video", "video": frames},
                {"type": "text", "text": "Same person?"},
            ],
        }
    ]
    out = llm.chat(conv, _greedy())[0]
    processor, model = _hf(str(tiny_qwen2_vl))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "video"},
                {"type": "text", "text": "Same person?"},
            ],
        }
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[prompt], images=[image], videos=[frames], return_tensors="pt")
    with torch.inference_mode():
        ref = model.generate(**enc.to(model.device), max_new_tokens=MAX_NEW, do_sample=False)
    ref = ref[0, enc["input_ids"].shape[1] :].tolist()
    assert out.outputs[0].token_ids == truncate_at_eos(ref, llm.engine.eos_token_ids)


@pytest.mark.parametrize(
    ("part", "error"),
    [
        ({"type": "video", "video": []}, InvalidRequestError),
        ({"type": "video", "video": "not-a-list"}, InvalidRequestError),
        ({"type": "video", "video": [noise_image(28, 28, 1)], "fps": -1}, InvalidRequestError),
        (
            {"type": "video", "video": [noise_image(56, 56, 1), noise_image(84, 56, 2)]},
            InvalidImageError,
        ),
    ],
)
def test_bad_clips_are_refused(engines, tiny_qwen2_vl, part, error):
    processor = engines(tiny_qwen2_vl).engine.processor
    with pytest.raises(error):
        processor.process([{"role": "user", "content": [part, {"type": "text", "text": "x"}]}])
