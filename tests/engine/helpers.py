"""Helpers for engine tests: synthetic images, conversations, the transformers reference."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from engine.device import resolve_device


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def text_conv(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def image_conv(text: str, *images: Image.Image) -> list[dict]:
    parts = [{"type": "image", "image": im} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@cache
def _hf(checkpoint: str):
    """The reference runs where the engine's ``device="auto"`` runs, so that on a GPU machine
    both sides use the same kernels (TF32 off: an fp32 reference must be fp32)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    device = resolve_device("auto")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32)
    return processor, model.to(device).eval()


def hf_greedy(
    checkpoint: Path, conversation: list[dict], max_new_tokens: int, **generate_kwargs: Any
) -> list[int]:
    """What a user gets from ``transformers`` ``generate()`` (greedy, fp32) for a conversation;
    ``generate_kwargs`` add logits processors (e.g. ``repetition_penalty``)."""
    processor, model = _hf(str(checkpoint))
    hf_messages, images = [], []
    for msg in conversation:
        content = msg["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for part in content:
            if part["type"] == "image":
                images.append(part["image"])
                parts.append({"type": "image"})
            else:
                parts.append(part)
        hf_messages.append({"role": msg["role"], "content": parts})
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=images or None, return_tensors="pt").to(model.device)
    with torch.inference_mode():
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False, **generate_kwargs
        )
    return out[0, enc["input_ids"].shape[1] :].tolist()


def truncate_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """HF stops at eos and includes it, as does the engine; compare up to the same point."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


# a synthetic step-cost model (seconds): 4 ms a step, 0.5 ms a prompt token, 1 ms a decode;
# tests of the scheduler's time limits drive it with this instead of the clock
SYNTHETIC_COSTS = {
    "fixed": 0.004,
    "prefill_tokens": 0.0005,
    "decode_tokens": 0.001,
    "attention_kunits": 0.0001,
    "encoder_kunits": 0.0002,
}


def step_logits(llm, conv, params) -> list:
    """The logits each step sampled from, for one greedy ``chat`` (a test's view of the
    sampler's input; the runner is left as it was)."""
    runner = llm.engine.runner
    logs: list = []
    sample = runner._sample

    def keep(logits, chunks):
        logs.append(logits.float().clone())
        return sample(logits, chunks)

    runner._sample = keep
    try:
        llm.chat(conv, params)
    finally:
        runner._sample = sample
    return logs
