"""Incremental detokenization: the Rust stream (``DecodeStream``) the engine uses for tokenizers
backed by ``tokenizers`` emits exactly what the Python window emits, delta by delta, and what
``tokenizer.decode`` returns for the whole output: for a byte-level BPE tokenizer (the Qwen
family's, from a generated checkpoint) and a SentencePiece-style one (Metaspace: a leading
space that depends on the token before), characters cut across tokens, special tokens, stop
strings, and a Rust tokenizer that fails mid-request."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

TEXTS = [
    "A person in a red coat walks past the bus stop.",
    "café 🚌 naïve 你好世界 — ok",
    "  leading spaces, trailing ones  ",
    "emoji run 👩‍👩‍👧‍👦🇯🇵 and tabs\tand\nnewlines",
]


class PythonWindowOnly:
    """The same tokenizer without its Rust backend: the detokenizer's Python window."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


@pytest.fixture(scope="module")
def byte_level(tiny_qwen2_vl):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2_vl)


@pytest.fixture(scope="module")
def metaspace():
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    sp = SentencePieceBPETokenizer()
    corpus = [t * 3 for t in TEXTS] + ["the quick brown fox jumps over the lazy dog"] * 5
    sp.train_from_iterator(corpus, vocab_size=400, special_tokens=["<unk>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>", eos_token="</s>")


def run(tokenizer, ids: list[int], params: SamplingParams, groups: list[int]) -> tuple:
    """Deltas, the final text and the stop hit of feeding ``ids`` in ``groups`` of tokens."""
    detok = IncrementalDetokenizer(tokenizer, params, [])
    deltas, i = [], 0
    for size in groups:
        chunk = ids[i : i + size]
        i += size
        deltas.append(detok.add(chunk, finished=i >= len(ids)))
        if detok.stop_hit is not None:
            deltas.append(detok.add([], True))
            break
    return deltas, detok.output_text(), detok.stop_hit


def both(tokenizer, ids, params, groups) -> tuple:
    streamed = run(tokenizer, ids, params, groups)
    windowed = run(PythonWindowOnly(tokenizer), ids, params, groups)
    return streamed, windowed


@pytest.mark.parametrize("family", ["byte_level", "metaspace"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_the_stream_emits_what_the_window_and_decode_emit(request, family, skip_special):
    tokenizer = request.getfixturevalue(family)
    assert IncrementalDetokenizer(tokenizer, SamplingParams(), [])._stream is not None
    special = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    rng = random.Random(7)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids = [*ids[:5], special, *ids[5:]]  # a special token mid-output
        params = SamplingParams(skip_special_tokens=skip_special)
        decoded = tokenizer.decode(ids, skip_special_tokens=skip_special)
        streamed, windowed = both(tokenizer, ids, params, [1] * len(ids))
        assert streamed == windowed, text  # token by token: delta for delta
        assert streamed[1] == decoded
        # several tokens a step (a speculative or multi-token step): the window holds back a
        # whole group that ends mid-character, the stream only that character's tokens
        streamed, windowed = both(tokenizer, ids, params, [rng.randint(1, 4) for _ in ids])
        assert streamed[1] == windowed[1] == decoded == "".join(streamed[0])
        sent_s = sent_w = ""
        for s, w in zip(streamed[0], windowed[0], strict=True):
            sent_s, sent_w = sent_s + s, sent_w + w
            assert sent_s.startswith(sent_w), text


def test_random_ids_and_characters_cut_at_the_end(byte_level):
    """Byte tokens in random order make invalid UTF-8 mid-output and at the end: held back
    until completed, flushed as U+FFFD when the request ends cut (as decode() renders it)."""
    rng = random.Random(3)
    vocab = len(byte_level)
    for trial in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(skip_special_tokens=trial % 2 == 0)
        streamed, windowed = both(byte_level, ids, params, [1] * len(ids))
        assert streamed == windowed, ids
        assert streamed[1] == byte_level.decode(ids, skip_special_tokens=trial % 2 == 0)
    cut = byte_level.encode("🚌", add_special_tokens=False)
    assert len(cut) > 1, "the emoji should span byte tokens"
    streamed, windowed = both(byte_level, cut[:-1], SamplingParams(), [1] * (len(cut) - 1))
    assert streamed == windowed
    assert streamed[1].endswith("\ufffd") and not any(d for d in streamed[0][:-1])


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_and_hold_back_alike(byte_level, include):
    text = "The bus stops here. Then it leaves the station again."
    ids = byte_level.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["here.", "never"], include_stop_str_in_output=include)
    streamed, windowed = both(byte_level, ids, params, [1] * len(ids))
    assert streamed == windowed
    assert streamed[2] == "here."
    assert streamed[1] == ("The bus stops here." if include else "The bus stops ")
    # no delta ever carried the start of the stop string before it was decided
    assert "".join(streamed[0]) == streamed[1]


def test_a_failing_stream_hands_over_to_the_window(byte_level, monkeypatch):
    import engine.detokenizer as detokenizer

    text = "café 🚌 naïve, then more words after the fault"
    ids = byte_level.encode(text, add_special_tokens=False)
    real = detokenizer.DecodeStream

    class FailingStream:
        def __init__(self, **kwargs) -> None:
            self.inner, self.steps = real(**kwargs), 0

        def step(self, backend, token):
            self.steps += 1
            if self.steps == 4:  # inside "café 🚌": mid-character
                raise RuntimeError("injected")
            return self.inner.step(backend, token)

    monkeypatch.setattr(detokenizer, "DecodeStream", FailingStream)
    for groups in ([1] * len(ids), [3] * len(ids)):
        streamed = run(byte_level, ids, SamplingParams(), groups)
        windowed = run(PythonWindowOnly(byte_level), ids, SamplingParams(), groups)
        assert "".join(streamed[0]) == streamed[1] == windowed[1] == text


def test_tokenizers_that_post_process_keep_the_window(metaspace, byte_level):
    metaspace.clean_up_tokenization_spaces = True
    try:
        detok = IncrementalDetokenizer(metaspace, SamplingParams(), [])
        assert detok._stream is None
    finally:
        metaspace.clean_up_tokenization_spaces = False

    class Shouting(type(byte_level)):
        """A model's tokenizer class with a decode of its own (as Whisper's has)."""

        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    shouting = Shouting.from_pretrained(byte_level.name_or_path)
    ids = shouting.encode("a person by the bus", add_special_tokens=False)
    detok = IncrementalDetokenizer(shouting, SamplingParams(), [])
    assert detok._stream is None
    text = "".join(detok.add([t], False) for t in ids) + detok.add([], True)
    assert text == "A PERSON BY THE BUS"
