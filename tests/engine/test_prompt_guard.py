"""The prompt length guard refuses only texts that really exceed the context, and refuses the
common over-long ones without tokenising them in full."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.errors import PromptTooLongError
from engine.prompt_guard import PromptLengthGuard, _cut_at_whitespace


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_vl: Path):
    return AutoTokenizer.from_pretrained(tiny_qwen2_vl)


def _texts(rng: random.Random) -> list[str]:
    """Ordinary, repetitive and adversarial texts (long whitespace runs, one long 'word',
    characters outside the tokenizer's usual range)."""
    words = ["camera", "person", "the", "a", "walks", "door", "12", "\n", "é", "人", "🙂", "  "]
    texts = []
    for n in (10, 100, 400, 1_000, 3_000, 10_000):
        texts.append(" ".join(rng.choice(words) for _ in range(n)))
        texts.append(" " * n)
        texts.append("x" * n)
        texts.append("".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(n)))
        texts.append(("ab " * n)[: n * 2])
    return texts


@pytest.mark.parametrize("max_model_len", [16, 64, 256])
def test_the_guard_never_refuses_a_text_that_fits(tokenizer, max_model_len: int) -> None:
    guard = PromptLengthGuard(tokenizer, max_model_len)
    rng = random.Random(max_model_len)
    refused = 0
    for text in _texts(rng):
        try:
            guard.check(text)
        except PromptTooLongError:
            refused += 1
            assert len(tokenizer(text)["input_ids"]) > max_model_len, text[:80]
    assert refused > 0  # the list has texts the guard catches


def test_a_huge_prompt_is_refused_in_milliseconds(tokenizer) -> None:
    guard = PromptLengthGuard(tokenizer, 4096)
    for text in ("hello world " * 4_000_000, "hello world " * 6_000):
        t0 = time.perf_counter()
        with pytest.raises(PromptTooLongError) as err:
            guard.check(text)
        assert time.perf_counter() - t0 < 2.0
        assert err.value.param == "messages"


@pytest.mark.parametrize(
    ("text", "cut"),
    [("ab cd ef", "ab cd"), ("ab  \n cd", "ab"), ("abcdef", "abcdef"), (" abc", " abc")],
)
def test_cut_at_whitespace(text: str, cut: str) -> None:
    assert _cut_at_whitespace(text) == cut
