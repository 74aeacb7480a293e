"""Incremental detokenization and stop strings.

Decoding only the tail window (``prefix_offset``/``read_offset``) keeps per-token cost flat, and
text ending in U+FFFD (a byte-level BPE token cut mid-character) is held back until the next
token completes it. With stop strings, the last ``max(len(stop)) - 1`` characters are also held
back so a streaming client never receives the start of a stop string that is later cut off.

A tokenizer backed by the Rust ``tokenizers`` library runs that same window algorithm in Rust
(``tokenizers.decoders.DecodeStream``, what vLLM's fast detokenizer uses): one call per token
instead of two ``transformers`` ``decode`` calls, ~1 µs against ~7.5 on a Zen 4 EPYC, paid by
every running sequence in every step (8 rows: ~60 µs of a ~5 ms int8 decode step). Tokenizers
without one, or whose ``decode`` post-processes the text (``clean_up_tokenization_spaces``),
keep the Python window.
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import SamplingParams

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

# tokens before the first undecoded one the Python window starts from when a stream hands over
# to it: context for decoders whose output depends on the token before (a leading space)
HANDOVER_CONTEXT_TOKENS = 5


# where transformers defines ``decode`` (the base class) and the fast tokenizers' ``_decode``
# (5.x: TokenizersBackend; 4.x: PreTrainedTokenizerFast): the Rust decode, then the optional
# clean-up. A model's tokenizer class that overrides either (Whisper's, Wav2Vec2's) does more.
LIBRARY_DECODE = {
    "decode": {"transformers.tokenization_utils_base"},
    "_decode": {
        "transformers.tokenization_utils_tokenizers",
        "transformers.tokenization_utils_fast",
    },
}


def rust_backend(tokenizer) -> Any | None:
    """The Rust tokenizer a ``DecodeStream`` can step, when its text is exactly what
    ``tokenizer.decode`` returns; None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is None or backend is None or not hasattr(backend, "decode"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None  # transformers post-processes decode()'s text; the stream would not
    for name, modules in LIBRARY_DECODE.items():
        owner = next((k for k in type(tokenizer).__mro__ if name in k.__dict__), None)
        if owner is None or owner.__module__ not in modules:
            return None
    return backend


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
        self._backend = rust_backend(tokenizer)
        self._stream = (
            DecodeStream(skip_special_tokens=params.skip_special_tokens)
            if self._backend is not None
            else None
        )
        self._undecoded = 0  # index of the first token the stream has not turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add(self, new_ids: list[int], finished: bool) -> str:
        """Feed new tokens; return the text delta to emit now."""
        if self._stream is not None:
            return self._add_streamed(new_ids, finished)
        self.token_ids.extend(new_ids)
        return self._add_windowed(finished)

    def _add_streamed(self, new_ids: list[int], finished: bool) -> str:
        old_len = len(self.text)
        for i, token in enumerate(new_ids):
            self.token_ids.append(token)
            try:
                piece = self._stream.step(self._backend, token)
            except Exception:  # an id the Rust tokenizer refuses: the Python window decides
                self.token_ids.extend(new_ids[i + 1 :])
                return self._hand_over(finished, old_len)
            if piece is not None:
                self.text += piece
                self._undecoded = len(self.token_ids)
        if finished and self._undecoded < len(self.token_ids):
            # a character cut mid-way at the end: the window emits what decode() would (U+FFFD)
            return self._hand_over(finished, old_len)
        if self.params.stop and len(self.text) > old_len:
            self._check_stop(old_len)
        return self._emit(finished)

    def _hand_over(self, finished: bool, old_len: int) -> str:
        """Continue in the Python window from the first token the stream left undecoded."""
        self._stream = None
        self.read_offset = self._undecoded
        self.prefix_offset = max(0, self._undecoded - HANDOVER_CONTEXT_TOKENS)
        if self.params.stop and len(self.text) > old_len:
            self._check_stop(old_len)
        if self.stop_hit is not None:
            return self._emit(finished)
        return self._add_windowed(finished)

    def _add_windowed(self, finished: bool) -> str:
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and (not full.endswith("\ufffd") or finished):
            old_len = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            if self.params.stop:
                self._check_stop(old_len)
        return self._emit(finished)

    def _emit(self, finished: bool) -> str:
        """The text delta that may leave now: all of it once finished or stopped, else all but
        what a stop string could still claim."""
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
