"""Incremental detokenization and stop strings.

Decoding only the tail window (``prefix_offset``/``read_offset``) keeps per-token cost flat, and
text ending in U+FFFD (a byte-level BPE token cut mid-character) is held back until the next
token completes it. With stop strings, the last ``max(len(stop)) - 1`` characters are also held
back so a streaming client never receives the start of a stop string that is later cut off.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""  # full decoded text (may include held-back characters)
        self.emitted = 0  # characters already handed out
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_hit: str | None = None
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add(self, new_ids: list[int], finished: bool) -> str:
        """Feed new tokens; return the text delta to emit now."""
        self.token_ids.extend(new_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and (not full.endswith("\ufffd") or finished):
            old_len = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            if self.params.stop:
                self._check_stop(old_len)
        if self.stop_hit is not None or finished:
            limit = len(self.text)
        else:
            limit = max(self.emitted, len(self.text) - self._holdback)
        delta = self.text[self.emitted : limit]
        self.emitted = limit
        return delta

    def _check_stop(self, old_len: int) -> None:
        search_from = max(0, old_len - self._holdback)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is not None:
            idx, stop = best
            end = idx + len(stop) if self.params.include_stop_str_in_output else idx
            self.text = self.text[:end]
            self.emitted = min(self.emitted, end)
            self.stop_hit = stop

    def output_text(self) -> str:
        return self.text[: self.emitted]
