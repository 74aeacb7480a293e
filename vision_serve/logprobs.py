"""The engine's per-token logprobs in OpenAI's two shapes (chat and legacy completions).

Token text: OpenAI returns each token as a string plus its exact UTF-8 ``bytes`` (a token can
hold half of a multi-byte character, which no string can show). Qwen's tokenizers are
byte-level BPE: every vocabulary entry spells its bytes through GPT-2's byte-to-character
table, so the bytes are recovered exactly by inverting that table. Entries outside the table
(added/special tokens) are their own text.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from engine.outputs import TokenLogprob


@lru_cache(maxsize=1)
def _char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: printable bytes map to themselves, the rest to
    code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenTexts:
    """Token id -> (text, bytes), cached: a stream asks for the same ids over and over."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        table = _char_to_byte()
        if token_id not in self._special and piece and all(c in table for c in piece):
            raw = bytes(table[c] for c in piece)
        else:  # an added token, or a tokenizer that is not byte-level
            text = piece if token_id in self._special else self.tokenizer.decode([token_id])
            raw = (text or "").encode("utf-8")
        return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one chunk's tokens)."""
    content = []
    for lp in entries:
        token, raw = texts(lp.token_id)
        top = []
        for tid, value in lp.top:
            alt, alt_raw = texts(tid)
            top.append({"token": alt, "logprob": value, "bytes": alt_raw})
        content.append({"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: list[TokenLogprob], texts: TokenTexts, text_offset: int = 0
) -> dict[str, Any]:
    """``choices[i].logprobs`` of a legacy completion: parallel lists, and per token a map of
    the top alternatives that always holds the sampled token too (so up to k + 1 entries, as
    OpenAI documents). ``text_offset`` is where the first token starts in the choice's text."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for lp in entries:
        token, _ = texts(lp.token_id)
        tokens.append(token)
        token_logprobs.append(lp.logprob)
        alternatives = {texts(tid)[0]: value for tid, value in lp.top}
        alternatives.setdefault(token, lp.logprob)
        top_logprobs.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
