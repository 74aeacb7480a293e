"""Refuse prompts that cannot fit the context before paying to tokenise them.

Tokenising is linear in the text but not cheap: on a 2-core CPU a 45 MB prompt took 150 s and
7 GB of memory before being refused as too long, so one request could hold a preprocessing
thread for minutes and a few could exhaust memory. Two checks, cheapest first:

1. **Characters** (exact, free): no token spells more than ``max_token_chars`` characters (the
   longest vocabulary entry, special tokens included), so a text longer than
   ``max_model_len * max_token_chars`` characters cannot fit, whatever it says.
2. **A prefix** (cheap, bounded): for long texts, tokenise only the first
   ``PREFIX_CHARS_PER_TOKEN * max_model_len`` characters, cut at whitespace so the prefix splits
   into the same pre-tokens as the full text. A prefix that alone needs more tokens than the
   context holds (plus a margin for the cut) proves the whole does too.

A text that passes both is tokenised in full as before, and the exact count decides.
"""

from __future__ import annotations

from typing import Any

from engine.errors import PromptTooLongError

# Typical text is 3-5 characters per token; 16 keeps the probe cheap (~0.15 s for a 4k context)
# while almost every over-long prompt is caught by it.
PREFIX_CHARS_PER_TOKEN = 16
# Tokens the whitespace cut may add or remove at the prefix's end, and special tokens the
# tokenizer may add to the whole text.
CUT_MARGIN_TOKENS = 64


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest vocabulary entry (byte-level BPE entries spell one character
    per byte, so this bounds the decoded text too)."""
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1) or 1


class PromptLengthGuard:
    """Cheap, never-wrong refusal of texts longer than ``max_model_len`` tokens."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_token_chars = longest_token_chars(tokenizer)
        self.max_chars = max_model_len * self.max_token_chars
        self.prefix_chars = max_model_len * PREFIX_CHARS_PER_TOKEN

    def check(self, text: str) -> None:
        """Raise :class:`PromptTooLongError` when ``text`` provably cannot fit the context."""
        if len(text) > self.max_chars:
            raise PromptTooLongError(
                f"prompt is {len(text)} characters; this model's context (max_model_len) is "
                f"{self.max_model_len} tokens, which cannot hold more than {self.max_chars} "
                "characters",
                param="messages",
            )
        if len(text) <= self.prefix_chars:
            return
        prefix = _cut_at_whitespace(text[: self.prefix_chars])
        n = len(self.tokenizer(prefix, add_special_tokens=False)["input_ids"])
        if n > self.max_model_len + CUT_MARGIN_TOKENS:
            raise PromptTooLongError(
                f"prompt is more than {n} tokens (its first {len(prefix)} characters alone); "
                f"this model's context (max_model_len) is {self.max_model_len}",
                param="messages",
            )


def _cut_at_whitespace(text: str) -> str:
    """``text`` up to (not including) its last whitespace run; unchanged if it has none."""
    for i in range(len(text) - 1, 0, -1):
        if text[i].isspace():
            while i > 0 and text[i - 1].isspace():
                i -= 1
            return text[:i] if i else text
    return text
