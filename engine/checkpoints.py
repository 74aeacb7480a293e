"""Randomly initialised Qwen2-VL / Qwen2.5-VL checkpoints, generated offline.

Tests and CPU benchmarks need a complete Hugging Face checkpoint directory (config, safetensors
weights, tokenizer, image/video processor, chat template, generation config) without network
access to the model hub.  :func:`make_model` builds one from scratch:

* a byte-level BPE tokenizer is trained on a small English corpus generated in code, with the
  family's special tokens appended after the BPE ids (as in the real Qwen tokenizers);
* the model config is built with the transformers config classes, so it is valid by construction
  and its token ids (image/video/vision markers, bos/eos/pad, vocab size) match the tokenizer;
* the weights are drawn from a seeded generator with a *wider* init than transformers' default
  (std 0.02 gives near-tied logits, so greedy decoding would be decided by numerical noise), and a
  self-check runs greedy generation and re-draws the weights (bounded, deterministic retries) until
  the output is diverse and its argmax margins are comfortably larger than fp32 noise.

Everything is deterministic for a given ``(family, preset, seed)``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports stay lazy so `vision-serve --help` remains fast
    from PIL import Image
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl")
PRESETS: tuple[str, ...] = ("tiny", "bench", "2b")

LOG_PREFIX = "make-model:"

# --------------------------------------------------------------------------------------------
# Tokens and template: the same strings, order and roles as the released Qwen checkpoints, so code
# written against a real checkpoint (token lookups by name, chat formatting) works unchanged.
# --------------------------------------------------------------------------------------------

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"

# Special tokens in their released id order (Qwen2-VL: 151643..151656).
QWEN2_VL_SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    VISION_START,
    VISION_END,
    "<|vision_pad|>",
    IMAGE_PAD,
    VIDEO_PAD,
)

# Qwen2.5-VL appends tool-call and fill-in-the-middle markers; they are *not* special there
# (``skip_special_tokens`` keeps them), so they are added as plain added tokens here too.
QWEN2_5_VL_EXTRA_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)

# The chat template shipped with Qwen2-VL and Qwen2.5-VL: a default system message when the
# conversation has none, image/video parts as vision placeholders, and an assistant header when
# ``add_generation_prompt`` is set. Extended with Qwen2.5's tool section (the ``# Tools`` system
# block, assistant ``<tool_call>`` blocks, ``tool`` messages as ``<tool_response>`` in a user
# turn); without ``tools`` or tool messages it renders exactly the original.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}{{ messages[0]['content'] }}"
    "{% else %}{% for c in messages[0]['content'] %}"
    "{% if 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n\\n' }}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user"
    "{% endif %}"
    "{{ '\\n' }}<tool_response>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '\\n' }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "{% if not tools and loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% set text = namespace(seen=false) %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% set text.seen = message['content'] != '' %}"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% set text.seen = text.seen or content['text'] != '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{% for tool_call in message['tool_calls'] or [] %}"
    "{% if tool_call['function'] is defined %}{% set tool_call = tool_call['function'] %}"
    "{% endif %}"
    "{% if text.seen or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call[\'name\'] }}", "arguments": '
    "{{ tool_call['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The pre-tokenisation split used by the Qwen2 tokenizer.  transformers' ``Qwen2Tokenizer``
# rebuilds its pipeline with this regex on load, so training with the same split keeps the merges
# we learn consistent with how the loaded tokenizer will segment text.
_QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Corpus seed is fixed (not the model seed): the tokenizer of a preset is the same for every
# --seed, so checkpoints that differ only in weights share token ids.
_CORPUS_SEED = 1234


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """Shapes of one checkpoint size; the same preset serves both families."""

    vocab_size: int  # config.vocab_size: embedding and lm_head rows
    corpus_sentences: int  # generated training sentences for the BPE
    invented_words: int  # invented proper nouns mixed in, so large vocabularies can be reached
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    mrope_section: tuple[int, int, int]  # (t, h, w); sums to head_dim / 2
    max_position_embeddings: int
    vision_depth: int
    vision_embed_dim: int
    vision_heads: int
    vision_intermediate_size: int  # Qwen2.5-VL SwiGLU width (Qwen2-VL uses mlp_ratio 4)
    patch_size: int
    window_size: int  # Qwen2.5-VL window attention span in pixels
    fullatt_block_indexes: tuple[int, ...]  # Qwen2.5-VL blocks with full attention
    min_pixels: int
    max_pixels: int
    # Init gains (std = gain / sqrt(fan_in)); see _init_weights for why these are wide.
    weight_gain: float
    logit_gain: float
    residual_gain: float  # extra factor on projections that write into the residual stream
    # len(tokenizer), special tokens included; 0: vocab_size. Released checkpoints pad their
    # embedding past the tokenizer (Qwen2-VL: 151,936 rows, 151,657 tokens); a smaller BPE
    # under a real model's row count gives its shapes without a corpus for 150k merges
    tokenizer_size: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def text_vocab(self) -> int:
        """Ids the tokenizer has: the added tokens take its last ones, padding rows follow."""
        return self.tokenizer_size or self.vocab_size


PRESET_SHAPES: dict[str, Preset] = {
    # ~1 MB: every code path (GQA, q/k/v bias, mrope, window attention, tied and untied
    # embeddings) at a size where a forward pass costs milliseconds.
    "tiny": Preset(
        vocab_size=1024,
        corpus_sentences=600,
        invented_words=300,
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        mrope_section=(2, 3, 3),
        max_position_embeddings=4096,
        vision_depth=2,
        vision_embed_dim=32,
        vision_heads=2,
        vision_intermediate_size=64,
        patch_size=14,
        window_size=56,  # 2x2 merged tokens per window
        fullatt_block_indexes=(1,),
        min_pixels=56 * 56,
        max_pixels=224 * 224,
        weight_gain=1.0,
        logit_gain=5.0,
        residual_gain=1.0,
    ),
    # Realistic proportions for CPU benchmarks (~0.1-0.2 B parameters): a 640x480 frame is not
    # downscaled and becomes 80x60 patches -> 1200 image tokens after the 2x2 merge.
    "bench": Preset(
        vocab_size=32000,
        corpus_sentences=12000,
        invented_words=24000,
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        mrope_section=(8, 12, 12),
        max_position_embeddings=32768,
        vision_depth=6,
        vision_embed_dim=384,
        vision_heads=6,
        vision_intermediate_size=1024,
        patch_size=8,
        window_size=64,  # 4x4 merged tokens per window
        fullatt_block_indexes=(2, 5),
        min_pixels=64 * 64,
        max_pixels=1280 * 960,
        weight_gain=1.0,
        logit_gain=5.0,
        residual_gain=0.3,
    ),
    # Qwen2-VL-2B-Instruct's shapes (GPU benchmarks, not CPU tests): every tensor as released
    # (its embedding padded past a 32k-token BPE), the 14-pixel patches, and its processor's
    # pixel bounds, so a 640x480 frame is 391 image tokens as in the real model. Released 2B
    # ties its embeddings (2.2 B parameters); qwen2_vl is saved untied here like the other
    # presets (2.44 B, 9.8 GB in fp32). The vision MLP width is Qwen2.5-VL-3B's, for that family.
    "2b": Preset(
        vocab_size=151936,
        tokenizer_size=32000,
        corpus_sentences=12000,
        invented_words=24000,
        hidden_size=1536,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        intermediate_size=8960,
        mrope_section=(16, 24, 24),
        max_position_embeddings=32768,
        vision_depth=32,
        vision_embed_dim=1280,
        vision_heads=16,
        vision_intermediate_size=3420,
        patch_size=14,
        window_size=112,
        fullatt_block_indexes=(7, 15, 23, 31),
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 16384,
        weight_gain=1.0,
        logit_gain=5.0,
        residual_gain=0.3,
    ),
}

# qwen2_vl is saved with a separate lm_head, qwen2_5_vl ties it to the input embeddings, so both
# weight-loading paths of an engine are exercised.
TIE_WORD_EMBEDDINGS: dict[str, bool] = {"qwen2_vl": False, "qwen2_5_vl": True}

SPATIAL_MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2

# Self-check thresholds (see self_check).
CHECK_NEW_TOKENS = 24
CHECK_MIN_DISTINCT = 6
CHECK_MIN_MEAN_MARGIN = 0.05
CHECK_MIN_MARGIN = 0.01
MAX_INIT_ATTEMPTS = 8

# lm_head rows of added tokens (eos, pad, vision placeholders...) are multiplied by this.
SPECIAL_ROW_SCALE = 0.1


def log(message: str) -> None:
    """Progress goes to stderr so stdout stays clean for the checkpoint path."""
    print(f"{LOG_PREFIX} {message}", file=sys.stderr, flush=True)


def _validate(family: str, preset: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid choices: {', '.join(FAMILIES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid choices: {', '.join(PRESETS)}")


def added_tokens(family: str) -> tuple[str, ...]:
    """All tokens appended after the BPE vocabulary, in id order."""
    if family == "qwen2_5_vl":
        return QWEN2_VL_SPECIAL_TOKENS + QWEN2_5_VL_EXTRA_TOKENS
    return QWEN2_VL_SPECIAL_TOKENS


def added_token_ids(family: str, vocab_size: int) -> dict[str, int]:
    """Ids of the added tokens: the last ``len(added_tokens(family))`` ids of the vocabulary.

    Fixed by design rather than read back from a tokenizer, so the config can be built (and
    checked) on its own; :func:`train_tokenizer` verifies the tokenizer agrees.
    """
    extra = added_tokens(family)
    first = vocab_size - len(extra)
    return {token: first + i for i, token in enumerate(extra)}


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------

_PEOPLE = (
    "a man", "a woman", "an old man", "an old woman", "a young girl", "a young boy", "two children",
    "three people", "a cyclist", "a jogger", "a delivery driver", "a police officer", "a nurse",
    "a street vendor", "a group of students", "the security guard", "a tall person", "a couple",
    "a tourist", "a mail carrier", "a worker", "a mother with a stroller", "a teenager",
)  # fmt: skip
_VEHICLES = (
    "car", "van", "bus", "truck", "taxi", "motorcycle", "bicycle", "scooter", "tram", "ambulance",
    "pickup truck", "delivery van", "fire engine", "police car", "tractor",
)  # fmt: skip
_COLOURS = (
    "red", "blue", "green", "yellow", "black", "white", "grey", "orange", "purple", "brown",
    "pink", "silver", "dark blue", "light green", "beige", "navy", "golden", "crimson", "teal",
)  # fmt: skip
_CLOTHES = (
    "jacket", "coat", "hat", "shirt", "dress", "backpack", "umbrella", "helmet", "scarf",
    "hoodie", "raincoat", "cap", "sweater", "uniform", "vest", "boots",
)  # fmt: skip
_ACTIONS = (
    "walks along", "crosses", "stands near", "waits at", "runs down", "rides past", "turns onto",
    "stops in front of", "looks at", "sits beside", "leaves", "enters", "hurries across",
    "carries a bag along", "talks on the phone near", "points at",
)  # fmt: skip
_PLACES = (
    "the main street", "the crosswalk", "the bus stop", "the corner shop", "the parking lot",
    "the north gate", "the train station", "the park entrance", "the bridge", "the market square",
    "the loading dock", "the school yard", "the intersection", "the garage door", "the fountain",
    "the bicycle lane", "the sidewalk", "the pharmacy", "the bakery", "the hotel lobby",
)  # fmt: skip
_SCENE = (
    "The light is dim and the sky is grey.", "It is raining and the road is wet.",
    "The sun is low and shadows are long.", "Snow covers the pavement.",
    "The street lamps are on.", "Fog makes the background blurry.",
    "The image is sharp and well exposed.", "The picture is slightly out of focus.",
    "There is heavy traffic in both directions.", "The scene is quiet and empty.",
    "A flock of pigeons lands on the roof.", "Music is playing from an open window.",
)  # fmt: skip
_CAMERA_OPENERS = (
    "Camera {n} shows", "In frame {n},", "At {h}:{m:02d},", "The {pos} camera records",
    "On the {pos} feed,", "Snapshot {n}:", "Around {h} o'clock,", "The lens at position {n} sees",
)  # fmt: skip
_POSITIONS = ("north", "south", "east", "west", "front", "rear", "left", "right", "upper", "lower")
_NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty", "thirty", "forty", "fifty", "hundred", "thousand",
)  # fmt: skip
_QUESTIONS = (
    ("How many people are visible?", "I can see {num} people."),
    ("What colour is the {veh}?", "The {veh} is {col}."),
    ("Describe the image.", "{person} in a {col} {cloth} {act} {place}."),
    ("Is anyone at {place}?", "Yes, {person} is there."),
    ("What is happening?", "{person} {act} {place} while a {col} {veh} passes by."),
)  # fmt: skip
_SYLLABLES = tuple(
    c + v for c in ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
                    "z", "br", "st", "tr", "ch", "sh", "gr", "pl", "kr")
    for v in ("a", "e", "i", "o", "u", "ai", "ou", "ar", "en", "or")
)  # fmt: skip
_NAME_SUFFIXES = ("", "", "n", "r", "s", "l", "th", "ck", "x", "nd")


def _invented_words(count: int, rng: random.Random) -> list[str]:
    """Distinct pronounceable capitalised names (streets, people, brands).

    A few hundred real sentences only support a few thousand BPE merges; a 32k vocabulary needs
    many distinct words, which these supply while the text still reads like English.
    """
    words: set[str] = set()
    while len(words) < count:
        parts = rng.choices(_SYLLABLES, k=rng.randint(2, 4))
        words.add(("".join(parts) + rng.choice(_NAME_SUFFIXES)).capitalize())
    return sorted(words)


def _scene_sentence(rng: random.Random) -> str:
    opener = rng.choice(_CAMERA_OPENERS).format(
        n=rng.randint(1, 64), h=rng.randint(0, 23), m=rng.randint(0, 59), pos=rng.choice(_POSITIONS)
    )
    return (
        f"{opener} {rng.choice(_PEOPLE)} in a {rng.choice(_COLOURS)} {rng.choice(_CLOTHES)} "
        f"{rng.choice(_ACTIONS)} {rng.choice(_PLACES)}."
    )


def _counting_sentence(rng: random.Random) -> str:
    count = rng.choice(_NUMBER_WORDS)
    veh = rng.choice(_VEHICLES)
    return (
        f"There are {count} {veh}s near {rng.choice(_PLACES)}, and {rng.randint(0, 999)} "
        f"frames were captured in {rng.randint(1, 60)} seconds."
    )


def _dialogue_sentence(rng: random.Random) -> str:
    question, answer = rng.choice(_QUESTIONS)
    answer = answer.format(
        num=rng.choice(_NUMBER_WORDS),
        veh=rng.choice(_VEHICLES),
        col=rng.choice(_COLOURS),
        person=rng.choice(_PEOPLE).capitalize(),
        cloth=rng.choice(_CLOTHES),
        act=rng.choice(_ACTIONS),
        place=rng.choice(_PLACES),
    )
    question = question.format(veh=rng.choice(_VEHICLES), place=rng.choice(_PLACES))
    return f"Question: {question}\nAnswer: {answer}"


def build_corpus(num_sentences: int, num_invented: int, seed: int = _CORPUS_SEED) -> list[str]:
    """A deterministic English-like corpus about cameras, people, streets, colours and numbers."""
    rng = random.Random(seed)
    makers = (_scene_sentence, _counting_sentence, _dialogue_sentence)
    lines = [rng.choice(makers)(rng) for _ in range(num_sentences)]
    lines.extend(_SCENE)
    for name in _invented_words(num_invented, rng):
        kind = rng.randrange(3)
        if kind == 0:
            lines.append(f"{name} Street is next to {rng.choice(_PLACES)}.")
        elif kind == 1:
            lines.append(f"{name} owns a {rng.choice(_COLOURS)} {rng.choice(_VEHICLES)}.")
        else:
            lines.append(f"The {name} camera has {rng.randint(2, 48)} megapixels.")
    return lines


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(family: str, preset: Preset) -> PreTrainedTokenizerBase:
    """Train a byte-level BPE and wrap it as transformers' ``Qwen2Tokenizer``.

    The BPE is trained to ``text_vocab - len(added tokens)`` so that the added tokens take the
    last ids and ``len(tokenizer) == preset.text_vocab`` exactly: only a preset that asks for
    them (``tokenizer_size``) has padding rows past the tokenizer, and their lm_head rows are
    zero, so they are never generated.  The initial alphabet is all 256
    byte symbols, so any text encodes and every id decodes to non-empty text.
    """
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    extra = added_tokens(family)
    bpe_size = preset.text_vocab - len(extra)

    bpe = Tokenizer(BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = build_corpus(preset.corpus_sentences, preset.invented_words)
    bpe.train_from_iterator(corpus, trainer)
    if bpe.get_vocab_size() != bpe_size:
        raise RuntimeError(
            f"BPE reached {bpe.get_vocab_size()} tokens, wanted {bpe_size}: enlarge the corpus"
        )

    model = json.loads(bpe.to_str())["model"]
    merges = [(left, right) for left, right in model["merges"]]
    return _wrap_qwen2_tokenizer(model["vocab"], merges, family, preset)


def _wrap_qwen2_tokenizer(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    family: str,
    preset: Preset,
) -> PreTrainedTokenizerBase:
    """Build the transformers tokenizer with Qwen's special-token roles and id order.

    ``<|endoftext|>`` is registered first (as the initial eos/pad) so it gets the first added id,
    like in the released vocabularies; the remaining specials follow in order, then eos is
    switched to ``<|im_end|>`` (chat models end turns with it) while pad stays ``<|endoftext|>``.
    """
    from tokenizers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        model_max_length=preset.max_position_embeddings,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_VL_SPECIAL_TOKENS[1:])})
    if family == "qwen2_5_vl":
        tokenizer.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t in QWEN2_5_VL_EXTRA_TOKENS]
        )
    tokenizer.eos_token = IM_END
    tokenizer.chat_template = CHAT_TEMPLATE

    expected = added_token_ids(family, preset.text_vocab)
    actual = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in expected}
    if actual != expected or len(tokenizer) != preset.text_vocab:
        raise RuntimeError(f"added-token ids {actual} differ from the design {expected}")
    return tokenizer


# --------------------------------------------------------------------------------------------
# Config, processor
# --------------------------------------------------------------------------------------------


def build_config(family: str, preset: Preset) -> Any:
    """The transformers config (``Qwen2VLConfig`` / ``Qwen2_5_VLConfig``) for a preset.

    Token ids come from :func:`added_token_ids`, the same ids the trained tokenizer is checked
    against, so config and tokenizer cannot drift apart.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    ids = added_token_ids(family, preset.text_vocab)
    if 2 * sum(preset.mrope_section) != preset.head_dim:
        raise ValueError("mrope_section must sum to head_dim / 2")
    text_config = {
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "max_position_embeddings": preset.max_position_embeddings,
        "max_window_layers": preset.num_layers,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": list(preset.mrope_section),
        },
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
    }
    vision_common = {
        "depth": preset.vision_depth,
        "num_heads": preset.vision_heads,
        "patch_size": preset.patch_size,
        "spatial_merge_size": SPATIAL_MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "in_channels": 3,
    }
    if family == "qwen2_vl":
        config_cls = Qwen2VLConfig
        # Qwen2-VL: embed_dim is the ViT width, hidden_size the merger output (= text width).
        vision_config = {
            **vision_common,
            "embed_dim": preset.vision_embed_dim,
            "hidden_size": preset.hidden_size,
            "mlp_ratio": 4,
        }
    else:
        config_cls = Qwen2_5_VLConfig
        # Qwen2.5-VL: hidden_size is the ViT width, out_hidden_size the merger output.
        vision_config = {
            **vision_common,
            "hidden_size": preset.vision_embed_dim,
            "intermediate_size": preset.vision_intermediate_size,
            "out_hidden_size": preset.hidden_size,
            "window_size": preset.window_size,
            "fullatt_block_indexes": list(preset.fullatt_block_indexes),
            "tokens_per_second": 2,
        }
    return config_cls(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=TIE_WORD_EMBEDDINGS[family],
        dtype="float32",
    )


def _vision_processor_kwargs(preset: Preset) -> dict[str, Any]:
    return {
        "size": {"shortest_edge": preset.min_pixels, "longest_edge": preset.max_pixels},
        "patch_size": preset.patch_size,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": SPATIAL_MERGE_SIZE,
    }


def build_image_processor(preset: Preset) -> Any:
    """``Qwen2VLImageProcessor`` for the preset (both families use this class).

    An image is resized to the nearest multiple of ``patch_size * merge_size`` per side, keeping
    its area within ``[min_pixels, max_pixels]``; it then yields ``(h / patch) * (w / patch)``
    patches and a quarter as many ``<|image_pad|>`` tokens (2x2 merge).
    """
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(**_vision_processor_kwargs(preset))


def build_processor(
    family: str, preset: Preset, tokenizer: PreTrainedTokenizerBase
) -> ProcessorMixin:
    """Image + video processor sized to the preset, joined with the tokenizer and template."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    processor_cls = Qwen2VLProcessor if family == "qwen2_vl" else Qwen2_5_VLProcessor
    return processor_cls(
        image_processor=build_image_processor(preset),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**_vision_processor_kwargs(preset)),
        chat_template=CHAT_TEMPLATE,
    )


def build_generation_config(family: str, preset: Preset) -> Any:
    """Greedy by default; stop on ``<|im_end|>`` or ``<|endoftext|>`` like the released models.

    No temperature/top-k/top-p defaults are written: with ``do_sample`` false they would only
    produce warnings, and engines that honour them could silently stop being greedy.
    """
    from transformers import GenerationConfig

    ids = added_token_ids(family, preset.text_vocab)
    return GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
        do_sample=False,
    )


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


# The text model's last RMSNorm (module path in transformers 5: model.language_model.norm).
_FINAL_NORM = "language_model.norm.weight"
# Projections whose output is added to a residual stream (text and vision blocks).
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "attn.proj.weight", "mlp.fc2.weight")


def _init_weights(model: PreTrainedModel, preset: Preset, first_added_id: int, seed: int) -> None:
    """Draw every parameter from a generator seeded with ``seed``.

    Why not transformers' init: with std 0.02 the logits of different tokens differ by ~1e-3, so
    greedy output is one repeated token and numerical noise decides the argmax.  Here:

    * matrices (linear, conv) get ``weight_gain / sqrt(fan_in)``: unit-scale activations at
      every width; those writing into the residual stream get an extra ``residual_gain``.  With
      12 unscaled layers the residual stream is dominated by the sum of block outputs and greedy
      falls into 2-token loops; a GPT-2-style damping (0.3 for ``bench``) keeps it diverse.  The
      3-layer ``tiny`` does not need it (and with tied embeddings gets *less* diverse with it);
    * embeddings and lm_head get ``logit_gain / sqrt(hidden)``, so logits have std ~``logit_gain``
      and top-1/top-2 margins are far above fp32 noise;
    * norm scales are ``1 +- 10%`` and biases ``N(0, 0.02)``: not the trivial values, so an engine
      that drops a norm weight or a q/k/v bias produces different tokens and fails its tests;
    * the final text norm also gets random signs.  With tied embeddings the logit of the token
      just read is ``~ e . e`` (large), so greedy repeats the input token forever; random signs
      make that self-similarity average out.

    The lm_head rows of added tokens (``<|im_end|>``/``<|endoftext|>`` eos/pad, vision
    placeholders, ...) are shrunk by ``SPECIAL_ROW_SCALE``: a random model would otherwise emit
    eos or ``<|image_pad|>`` at arbitrary points, making generations end trivially early or
    contain tokens an engine must treat specially.  In practice greedy never picks them, so
    generations run to ``max_tokens``.  With tied embeddings this also shrinks their input
    embeddings, which is harmless: the first RMSNorm rescales the residual.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    lm_head = model.get_output_embeddings().weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param is lm_head or name.endswith("embed_tokens.weight"):
                std = preset.logit_gain / preset.hidden_size**0.5
            elif param.ndim == 1:
                if name.endswith("bias"):
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
                else:  # RMSNorm / LayerNorm scale
                    param.copy_(1.0 + torch.randn(param.shape, generator=gen) * 0.1)
                    if name.endswith(_FINAL_NORM):
                        param.mul_(torch.randint(0, 2, param.shape, generator=gen) * 2.0 - 1.0)
                continue
            else:
                fan_in = param[0].numel()
                std = preset.weight_gain / fan_in**0.5
                if name.endswith(_RESIDUAL_OUTPUTS):
                    std *= preset.residual_gain
            param.copy_(torch.randn(param.shape, generator=gen) * std)
        lm_head[first_added_id:] *= SPECIAL_ROW_SCALE
        lm_head[preset.text_vocab :] = 0.0  # padding rows: ids no tokenizer decodes


def build_model(family: str, preset: Preset, seed: int) -> PreTrainedModel:
    """Instantiate the family's ``...ForConditionalGeneration`` and initialise it from ``seed``."""
    import torch
    from transformers import AutoModelForImageTextToText

    # transformers' own init draws from the global RNG; fork it so callers' state is untouched
    # (every parameter is overwritten from ``seed`` below anyway).
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForImageTextToText.from_config(
            build_config(family, preset), dtype=torch.float32
        )
    _init_weights(model, preset, added_token_ids(family, preset.text_vocab)[ENDOFTEXT], seed)
    model.generation_config = build_generation_config(family, preset)
    model.eval()
    return model


def count_parameters(model: PreTrainedModel) -> int:
    """Unique parameters (a tied lm_head counts once)."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Self-check
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GreedyStats:
    """What the self-check measured on one prompt."""

    tokens: list[int]
    distinct: int
    mean_margin: float
    min_margin: float

    def ok(self) -> bool:
        return (
            self.distinct >= CHECK_MIN_DISTINCT
            and self.mean_margin > CHECK_MIN_MEAN_MARGIN
            and self.min_margin > CHECK_MIN_MARGIN
        )


def check_image(size: tuple[int, int] = (112, 112)) -> Image.Image:
    """A deterministic, non-uniform RGB image (gradients + a square) for checks and tests."""
    import numpy as np
    from PIL import Image

    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack(
        [
            (x * 255 // max(width - 1, 1)),
            (y * 255 // max(height - 1, 1)),
            ((x + y) * 3) % 256,
        ],
        axis=-1,
    ).astype(np.uint8)
    rgb[height // 4 : height // 2, width // 4 : width // 2] = (220, 30, 30)
    return Image.fromarray(rgb, mode="RGB")


def check_prompts(min_pixels: int) -> list[tuple[str, list[dict[str, Any]], list[Image.Image]]]:
    """One text-only and one image conversation; the image is the smallest the preset allows."""
    side = max(56, int(min_pixels**0.5))
    image = check_image((side, side))
    text = [{"role": "user", "content": "Describe what the camera on the main street shows."}]
    vision = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}],
        }
    ]
    return [("text", text, []), ("image", vision, [image])]


def greedy_stats(
    model: PreTrainedModel,
    processor: ProcessorMixin,
    messages: list[dict[str, Any]],
    images: list[Image.Image],
    max_new_tokens: int = CHECK_NEW_TOKENS,
) -> GreedyStats:
    """Greedy-generate and measure diversity and the top-1/top-2 logit margin per step."""
    import torch

    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logits = torch.cat(out.logits, dim=0).float()
    top2 = logits.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    return GreedyStats(
        tokens=tokens,
        distinct=len(set(tokens)),
        mean_margin=float(margins.mean()),
        min_margin=float(margins.min()),
    )


def self_check(
    model: PreTrainedModel, processor: ProcessorMixin, preset: Preset, eos_ids: set[int]
) -> tuple[bool, str]:
    """Is greedy output diverse, decided by clear margins, and not ended at the first step?

    ``min_new_tokens`` keeps generate from stopping at eos so the statistics cover every step;
    a first-step eos is checked separately from the raw tokens.
    """
    ok = True
    notes = []
    for label, messages, images in check_prompts(preset.min_pixels):
        stats = greedy_stats(model, processor, messages, images)
        first_is_eos = stats.tokens[0] in eos_ids
        ok = ok and stats.ok() and not first_is_eos
        notes.append(
            f"{label}: {stats.distinct} distinct/{len(stats.tokens)}, "
            f"margin mean {stats.mean_margin:.3f} min {stats.min_margin:.4f}"
            + (", first token is eos" if first_is_eos else "")
        )
    return ok, "; ".join(notes)


def derived_seed(seed: int, attempt: int) -> int:
    """Attempt 0 uses ``seed`` itself; retries use distinct, reproducible seeds."""
    return seed if attempt == 0 else (seed * 1_000_003 + attempt * 7_919) % (2**63)


def build_checked_model(
    family: str, preset: Preset, processor: ProcessorMixin, seed: int
) -> PreTrainedModel:
    """Initialise from ``seed``; on a failed self-check retry with derived seeds (bounded)."""
    ids = added_token_ids(family, preset.text_vocab)
    eos_ids = {ids[IM_END], ids[ENDOFTEXT]}
    for attempt in range(MAX_INIT_ATTEMPTS):
        attempt_seed = derived_seed(seed, attempt)
        log(f"initialising weights (seed {attempt_seed}, attempt {attempt + 1})")
        model = build_model(family, preset, attempt_seed)
        log("self-check: greedy generation on a text and an image prompt")
        ok, notes = self_check(model, processor, preset, eos_ids)
        log(f"self-check {'passed' if ok else 'failed'}: {notes}")
        if ok:
            return model
    raise RuntimeError(f"no initialisation passed the self-check in {MAX_INIT_ATTEMPTS} tries")


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def make_model(family: str, preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a complete random checkpoint of ``family``/``preset`` to ``out_dir``; return it."""
    _validate(family, preset)
    shapes = PRESET_SHAPES[preset]
    out = Path(out_dir)
    start = time.perf_counter()

    log(f"training {shapes.text_vocab}-token byte-level BPE tokenizer ({family}/{preset})")
    tokenizer = train_tokenizer(family, shapes)
    processor = build_processor(family, shapes, tokenizer)
    model = build_checked_model(family, shapes, processor, seed)
    log(f"saving {count_parameters(model) / 1e6:.2f}M parameters to {out}")
    save_checkpoint(model, processor, out)
    log(f"done in {time.perf_counter() - start:.1f}s")
    return out


def save_checkpoint(model: PreTrainedModel, processor: ProcessorMixin, out: Path) -> None:
    """Write weights (safetensors), configs, tokenizer, processor and chat template."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    _save_preprocessor_config(processor, out)
    # The weights file is written through a private temp file (mode 0600); make it readable like
    # the JSON files so a server running as another user (e.g. in a container) can load it.
    for weights in out.glob("*.safetensors"):
        weights.chmod(0o644)


def _save_preprocessor_config(processor: ProcessorMixin, out: Path) -> None:
    """Also write the image processor on its own, as released Qwen checkpoints do.

    transformers 5 nests it inside ``processor_config.json``; a standalone
    ``preprocessor_config.json`` keeps ``AutoImageProcessor`` and code that reads that file working.
    ``min_pixels``/``max_pixels`` duplicate ``size`` for readers that expect the pre-v5 keys (the
    image processor maps them back onto ``size`` when loading, so the two cannot disagree).
    """
    image_processor = processor.image_processor
    image_processor.save_pretrained(out)
    path = out / "preprocessor_config.json"
    data = json.loads(path.read_text())
    data["min_pixels"] = image_processor.size["shortest_edge"]
    data["max_pixels"] = image_processor.size["longest_edge"]
    data["processor_class"] = type(processor).__name__
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_make_model_cli(subparsers: argparse._SubParsersAction) -> None:
    """Register ``make-model``: write a random checkpoint for tests and benchmarks."""
    parser = subparsers.add_parser(
        "make-model",
        help="generate a randomly initialised Qwen2-VL / Qwen2.5-VL checkpoint offline",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--family", choices=FAMILIES, default="qwen2_vl")
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (deterministic)")
    parser.set_defaults(func=run_make_model)


def run_make_model(args: argparse.Namespace) -> int:
    """CLI entry: print the checkpoint path on stdout."""
    path = make_model(args.family, args.preset, args.out, seed=args.seed)
    print(path)
    return 0


__all__ = [
    "FAMILIES",
    "PRESETS",
    "PRESET_SHAPES",
    "add_make_model_cli",
    "make_model",
    "run_make_model",
]
