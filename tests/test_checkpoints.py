"""Random Qwen2-VL / Qwen2.5-VL checkpoints load and run in transformers, offline.

Each tiny checkpoint is generated once per module (a few seconds each); ``bench`` is only checked
for shape invariants here (building it takes ~15 s and writes ~0.5 GB).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

from engine import checkpoints  # noqa: E402
from engine.checkpoints import (  # noqa: E402
    ENDOFTEXT,
    FAMILIES,
    IM_END,
    IMAGE_PAD,
    PRESET_SHAPES,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    add_make_model_cli,
    added_tokens,
    check_image,
    make_model,
)

TINY = PRESET_SHAPES["tiny"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(family, checkpoint dir) for each family's tiny preset, built once per module."""
    family = request.param
    out = make_model(family, "tiny", tmp_path_factory.mktemp(family), seed=0)
    return family, out


@pytest.fixture(scope="module")
def loaded(tiny: tuple) -> tuple:
    """(family, dir, processor, model) loaded through the Auto classes, as a user would."""
    family, out = tiny
    processor = transformers.AutoProcessor.from_pretrained(out)
    model = transformers.AutoModelForImageTextToText.from_pretrained(out)
    return family, out, processor, model.eval()


def _tensor_names(out: Path) -> set[str]:
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _image_conversation(text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


# ------------------------------------------------------------------------------ validation


def test_unknown_family_names_valid_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="qwen2_vl, qwen2_5_vl"):
        make_model("llava", "tiny", tmp_path)


def test_unknown_preset_names_valid_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny, bench"):
        make_model("qwen2_vl", "huge", tmp_path)


# ------------------------------------------------------------------------------ files, config


def test_writes_complete_checkpoint(tiny: tuple) -> None:
    _, out = tiny
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "processor_config.json",
        "chat_template.jinja",
    ):
        assert (out / name).is_file(), name
    # "a few MB"
    assert (out / "model.safetensors").stat().st_size < 8 * 1024 * 1024


def test_config_matches_tokenizer(loaded: tuple) -> None:
    family, _, processor, model = loaded
    tok = processor.tokenizer
    cfg = model.config
    ids = tok.convert_tokens_to_ids
    assert cfg.image_token_id == ids(IMAGE_PAD)
    assert cfg.video_token_id == ids(VIDEO_PAD)
    assert cfg.vision_start_token_id == ids(VISION_START)
    assert cfg.vision_end_token_id == ids(VISION_END)
    text = cfg.text_config
    assert text.vocab_size == len(tok) == TINY.vocab_size
    assert text.eos_token_id == tok.eos_token_id == ids(IM_END)
    assert text.pad_token_id == tok.pad_token_id == ids(ENDOFTEXT)
    assert text.bos_token_id == ids(ENDOFTEXT)
    # added tokens take the last ids, in the released order
    extra = added_tokens(family)
    assert [ids(t) for t in extra] == list(range(len(tok) - len(extra), len(tok)))


def test_tiny_shapes(loaded: tuple) -> None:
    family, _, _, model = loaded
    text = model.config.text_config
    vision = model.config.vision_config
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (64, 4, 2)
    assert text.hidden_size // text.num_attention_heads == 16
    assert text.rope_parameters["mrope_section"] == [2, 3, 3]
    assert sum(text.rope_parameters["mrope_section"]) * 2 == 16
    assert (vision.depth, vision.num_heads, vision.patch_size) == (2, 2, 14)
    assert (vision.spatial_merge_size, vision.temporal_patch_size) == (2, 2)
    if family == "qwen2_5_vl":
        assert vision.out_hidden_size == text.hidden_size
        assert list(vision.fullatt_block_indexes) == [1]
    else:
        assert vision.hidden_size == text.hidden_size
    assert model.config.dtype in (torch.float32, "float32")


def test_tied_and_untied_embeddings(loaded: tuple) -> None:
    family, out, _, model = loaded
    names = _tensor_names(out)
    tied = family == "qwen2_5_vl"
    assert model.config.tie_word_embeddings is tied
    assert ("lm_head.weight" in names) is not tied
    same = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert same is tied
    # q/k/v carry biases, as in the real models
    assert any(n.endswith("self_attn.q_proj.bias") for n in names)


def test_generation_config_is_greedy(loaded: tuple) -> None:
    _, _, processor, model = loaded
    gen = model.generation_config
    tok = processor.tokenizer
    assert gen.do_sample is False
    assert list(gen.eos_token_id) == [tok.convert_tokens_to_ids(IM_END), tok.pad_token_id]
    assert gen.pad_token_id == tok.pad_token_id


# ------------------------------------------------------------------------------ tokenizer


def test_every_id_decodes_to_text(loaded: tuple) -> None:
    _, _, processor, _ = loaded
    tok = processor.tokenizer
    assert all(tok.decode([i]) for i in range(len(tok)))


def test_tokenizer_roundtrip(loaded: tuple) -> None:
    _, _, processor, _ = loaded
    tok = processor.tokenizer
    text = "Camera 7 shows a man in a red jacket near the bus stop at 18:45."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # merges were learned, not just bytes


def test_chat_template(loaded: tuple) -> None:
    _, _, processor, _ = loaded
    prompt = processor.apply_chat_template(
        _image_conversation("Hi"), add_generation_prompt=True, tokenize=False
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ]
    assert processor.apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
    )


# ------------------------------------------------------------------------------ processor


@pytest.mark.parametrize(
    ("size", "grid"),
    [((112, 112), (1, 8, 8)), ((224, 168), (1, 12, 16)), ((40, 40), (1, 4, 4))],
)
def test_processor_image_tokens(loaded: tuple, size: tuple[int, int], grid: tuple) -> None:
    """112x112 -> 8x8 patches of 14 px -> 16 tokens; tiny images are upscaled to min_pixels."""
    _, _, processor, model = loaded
    prompt = processor.apply_chat_template(
        _image_conversation(), add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=[prompt], images=[check_image(size)], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [list(grid)]
    n_tokens = grid[0] * grid[1] * grid[2] // 4
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == n_tokens
    assert inputs["pixel_values"].shape == (grid[0] * grid[1] * grid[2], 3 * 2 * 14 * 14)


# ------------------------------------------------------------------------------ generation


def _greedy(processor, model, messages: list[dict], images: list | None) -> list[int]:
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_generate_text_prompt_is_diverse(loaded: tuple) -> None:
    _, _, processor, model = loaded
    messages = [{"role": "user", "content": "Tell me about the street outside."}]
    tokens = _greedy(processor, model, messages, None)
    assert len(tokens) == 16  # did not stop at eos
    assert len(set(tokens)) >= 5
    assert isinstance(processor.decode(tokens), str)


def test_generate_image_prompt_is_diverse(loaded: tuple) -> None:
    _, _, processor, model = loaded
    tokens = _greedy(processor, model, _image_conversation(), [check_image((112, 112))])
    assert len(tokens) == 16
    assert len(set(tokens)) >= 5


def test_image_changes_the_output(loaded: tuple) -> None:
    """The vision tower is wired in: a different image gives a different continuation."""
    _, _, processor, model = loaded
    first = _greedy(processor, model, _image_conversation(), [check_image((112, 112))])
    flipped = check_image((112, 112)).transpose(0)  # mirror left-right
    second = _greedy(processor, model, _image_conversation(), [flipped])
    assert first != second


# ------------------------------------------------------------------------------ determinism, CLI


def test_cli_reproduces_checkpoint(tiny: tuple, tmp_path: Path, capsys) -> None:
    """Same family/preset/seed via the CLI -> byte-identical weights and tokenizer."""
    family, out = tiny
    parser = argparse.ArgumentParser()
    add_make_model_cli(parser.add_subparsers(dest="command"))
    again = tmp_path / "again"
    args = parser.parse_args(
        ["make-model", "--family", family, "--preset", "tiny", "--out", str(again), "--seed", "0"]
    )
    assert args.func is checkpoints.run_make_model
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(again)
    log = captured.err
    for phase in ("tokenizer", "initialising", "self-check", "saving"):
        assert any(line.startswith("make-model:") and phase in line for line in log.splitlines())
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


def test_seed_changes_weights() -> None:
    a = checkpoints.build_model("qwen2_vl", TINY, seed=1)
    b = checkpoints.build_model("qwen2_vl", TINY, seed=2)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_cli_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_make_model_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-model", "--out", "x"])
    assert (args.family, args.preset, args.seed) == ("qwen2_vl", "tiny", 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["make-model", "--out", "x", "--family", "llava"])


# ------------------------------------------------------------------------------ bench preset


def test_bench_preset_invariants() -> None:
    """Shapes only (no weights): 640x480 stays unscaled -> 1200 tokens; < 300M parameters."""
    bench = PRESET_SHAPES["bench"]
    assert bench.head_dim == 64 and 2 * sum(bench.mrope_section) == bench.head_dim
    image_processor = checkpoints.build_image_processor(bench)
    assert image_processor.get_number_of_image_patches(480, 640, {}) == 80 * 60
    for family in FAMILIES:
        config = checkpoints.build_config(family, bench)
        with torch.device("meta"):
            model = transformers.AutoModelForImageTextToText.from_config(config)
        n_params = sum(p.numel() for p in model.parameters())
        assert 50e6 < n_params < 300e6, (family, n_params)
        assert config.text_config.vocab_size == bench.vocab_size == 32000


def test_corpus_is_deterministic() -> None:
    assert checkpoints.build_corpus(50, 20) == checkpoints.build_corpus(50, 20)


def test_config_json_has_no_sampling_defaults(tiny: tuple) -> None:
    _, out = tiny
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["do_sample"] is False
    assert not {"temperature", "top_k", "top_p"} & gen.keys()


# ------------------------------------------------------------------------------ 2b preset


def test_2b_preset_has_qwen2_vl_2b_shapes() -> None:
    """Shapes only (no weights): Qwen2-VL-2B's tensors, its 151,936-row embedding over a
    32k-token tokenizer, and its processor's 391 tokens for a 640x480 frame."""
    shapes = PRESET_SHAPES["2b"]
    assert (shapes.vocab_size, shapes.text_vocab) == (151936, 32000)
    image_processor = checkpoints.build_image_processor(shapes)
    assert image_processor.get_number_of_image_patches(480, 640, {}) == 4 * 391
    config = checkpoints.build_config("qwen2_vl", shapes)
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size) == (1536, 28, 8960)
    assert (text.num_attention_heads, text.num_key_value_heads) == (12, 2)
    assert text.vocab_size == 151936 and config.image_token_id < shapes.text_vocab
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    # released 2.2 B with a tied embedding; untied here: + 151,936 x 1,536
    assert 2.3e9 < n_params < 2.5e9, n_params


@pytest.fixture(scope="module")
def padded_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with 64 embedding rows past its tokenizer, as released checkpoints pad."""
    import dataclasses

    shapes = dataclasses.replace(TINY, vocab_size=TINY.vocab_size + 64, tokenizer_size=1024)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(checkpoints.PRESET_SHAPES, "tiny-padded", shapes)
        mp.setattr(checkpoints, "PRESETS", (*checkpoints.PRESETS, "tiny-padded"))
        return make_model("qwen2_vl", "tiny-padded", tmp_path_factory.mktemp("padded"), seed=0)


def test_padded_vocab_checkpoint(padded_vocab: Path) -> None:
    """Config rows past the tokenizer: added tokens keep the tokenizer's last ids, the padding
    rows of the lm_head are zero, and the engine's greedy tokens equal ``generate()``'s."""
    from engine import LLM, SamplingParams
    from tests.engine.helpers import hf_greedy, text_conv

    config = json.loads((padded_vocab / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(padded_vocab)
    assert len(tokenizer) == 1024
    assert config["text_config"]["vocab_size"] == 1088
    assert tokenizer.convert_tokens_to_ids(IM_END) < 1024
    with safe_open(str(padded_vocab / "model.safetensors"), "pt") as f:
        head = next(f.get_tensor(n) for n in f.keys() if n.endswith("lm_head.weight"))  # noqa: SIM118
    assert head.shape[0] == 1088 and not head[1024:].any()

    conv = text_conv("A bus stops by the school")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = LLM(str(padded_vocab), dtype="float32").chat(conv, params)[0].outputs[0]
    assert got.token_ids == hf_greedy(padded_vocab, conv, 12, min_new_tokens=12)
    assert max(got.token_ids) < 1024 and got.text
