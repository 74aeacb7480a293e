"""Weight-only int8 (``--quantization int8``): the layer computes exactly with its dequantized
weight (kernel or not), the rounding error is bounded, and the model's logits and greedy
tokens track fp32's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.kernels import load_cpu_decode, load_int8_linear
from engine.layers.quantized import Int8Linear, quantize_int8
from tests.engine.helpers import image_conv, noise_image, step_logits, text_conv

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [
    text_conv("The station entrance at night"),
    text_conv("A person in a red jacket walks to the door and waits."),
    text_conv("Count the cars."),
    image_conv("Who is here?", noise_image(112, 84, 5)),
    image_conv("Describe the scene.", noise_image(56, 112, 9)),
]


def test_rounding_error_is_at_most_half_a_step_per_weight() -> None:
    w = torch.randn(64, 96) * torch.linspace(0.01, 3, 64)[:, None]
    w[3] = 0  # an all-zero row must not divide by zero
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (q.float() * scales[:, None] - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-7).all()
    assert (q[3] == 0).all()


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_matches_its_dequantized_weight_with_and_without_the_kernel(rows, bias) -> None:
    torch.manual_seed(rows)
    lin = nn.Linear(200, 77, bias=bias)  # K not a multiple of 8: the kernel's scalar tail
    x = torch.randn(2, rows, 200)
    kernels = load_int8_linear()
    layers = [Int8Linear(lin, None)] + ([Int8Linear(lin, kernels)] if kernels else [])
    want = torch.nn.functional.linear(x, layers[0].dequantize(), layers[0].bias)
    for layer in layers:
        got = layer(x)
        assert got.shape == (2, rows, 77)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bf16 activations come back as bf16
    assert layers[-1](x.bfloat16()).dtype == torch.bfloat16
    # where bf16 arithmetic is native, prefill-sized bf16 products take bf16 x int8-as-bf16:
    # the same product up to one more bf16 rounding of it
    native = Int8Linear(lin, kernels, bf16_products=True)
    xb = x.bfloat16()
    want_b = torch.nn.functional.linear(xb.float(), layers[0].dequantize(), layers[0].bias)
    got_b = native(xb)
    assert got_b.dtype == torch.bfloat16
    torch.testing.assert_close(got_b.float(), want_b, rtol=2**-7, atol=1e-2)


def test_quantization_flag_is_validated() -> None:
    assert EngineArgs(quantization="none").quantization is None
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="int4")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request, tiny_qwen2_vl):
    """Unquantized and int8 weights with the same activations: fp32 (eager, int8 GEMV) or bf16
    (the fused decode step where the kernels build, both sides)."""
    kw = {"dtype": request.param, "device": "cpu", "max_num_batched_tokens": 256}
    return LLM(str(tiny_qwen2_vl), **kw), LLM(str(tiny_qwen2_vl), quantization="int8", **kw)


def test_every_decoder_linear_is_int8_and_the_vision_tower_is_not(pair) -> None:
    _, int8 = pair
    model = int8.engine.model
    decoder = [m for n, m in model.named_modules() if not n.startswith("visual")]
    assert any(isinstance(m, Int8Linear) for m in decoder)
    assert not any(isinstance(m, nn.Linear) for m in decoder)
    assert not any(isinstance(m, Int8Linear) for m in model.visual.modules())


def test_logits_and_greedy_tokens_track_the_unquantized_model(pair) -> None:
    """Stated bounds, measured on the tiny checkpoint: per-step relative logit error under 3 %
    with fp32 activations, 4 % with bf16 ones (their rounding adds to the weights': 3.1 % at
    worst, measured), and greedy tokens equal wherever the unquantized top-2 margin exceeds
    twice the logit error (a near-tie may flip). Position by position, a flip changes the
    rest of its sequence: fp32 agreed on 40/40 tokens, bf16 on 25/40 -- bf16 alone agrees
    with fp32 on 33/40 and bf16 + int8 on 32/40, so two bf16 runs compound their near-ties.
    The figures for the bench checkpoint are printed by benchmarks/int8.py (agreement, logit
    error)."""
    fp32, int8 = pair
    fp32_acts = fp32.engine.dtype == torch.float32
    bound, min_agreement = (0.03, 0.8) if fp32_acts else (0.04, 0.55)
    kernels = load_cpu_decode()
    if not fp32_acts and kernels is not None and kernels.int8_activation_bits == 8:
        bound = 0.06  # activations rounded to int8 too: at worst 5.0 % (Zen 3), 4.0 % (Zen 4)
    agree = total = 0
    for conv in PROMPTS:
        # tokens and logits from the same run: a second run of a prompt hits the prefix cache
        # and takes other kernels (a bf16 near-tie may then flip), so the logits of one run
        # compared under the tokens of another set contexts that differ side by side
        ref, q = step_logits(fp32, conv, GREEDY), step_logits(int8, conv, GREEDY)
        want = [int(r.argmax(-1)[0]) for r in ref]
        got = [int(g.argmax(-1)[0]) for g in q]
        agree += sum(a == b for a, b in zip(want, got, strict=True))
        total += len(want)
        for step, (g, r) in enumerate(zip(q, ref, strict=True)):
            if got[:step] != want[:step]:
                break
            rel = ((g - r).norm() / r.norm()).item()
            assert rel < bound, f"step {step}: relative logit error {rel:.4f}"
            top2 = r.topk(2, dim=-1).values[0]
            if (top2[0] - top2[1]).item() > 2 * (g - r).abs().max().item():
                assert got[step] == want[step], f"step {step}: a confident token changed"
    assert agree / total >= min_agreement, f"greedy agreement {agree}/{total}"


# ---- int8 weights inside the fused CPU decode step (bf16 activations) -----------------------

needs_decode_kernel = pytest.mark.skipif(
    load_cpu_decode() is None, reason="needs AVX-512 or AVX2 and a C++ compiler"
)


def _activation_bits() -> list[int]:
    """Every activation precision this build's int8 panels can take (PanelGemv's
    activation_bits): 0 (widened to fp32) everywhere, 8 with an integer dot product, 16 with
    AVX512-VNNI; the machine's own is one of them."""
    kernels = load_cpu_decode()
    return list(kernels.int8_activation_bits_supported) if kernels is not None else [0]


@needs_decode_kernel
def test_int8_panels_refuse_a_precision_this_build_lacks() -> None:
    kernels = load_cpu_decode()
    assert kernels.int8_activation_bits in _activation_bits()
    q, scales = quantize_int8(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="activation_bits 4"):
        kernels.PanelGemv(q, scales, activation_bits=4)
    if 16 not in _activation_bits():
        with pytest.raises(RuntimeError, match="activation_bits 16"):
            kernels.PanelGemv(q, scales, activation_bits=16)


@needs_decode_kernel
@pytest.mark.parametrize("bits", _activation_bits())
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize(("n", "k"), [(32, 64), (45, 130), (97, 301), (40, 700)])
def test_int8_panels_compute_with_the_dequantized_weight(bits, rows, n, k) -> None:
    """The fused step's int8 GEMV (panels, any row count): a last panel short of 32 features,
    odd K, K past one 256-k chunk, every row-block shape (1-2 rows both panel halves, more in
    half blocks on AVX2, 8-row blocks for VNNI's int8), each activation precision the build
    has. Where activations are widened to fp32 only the summation order differs from
    x @ (q * s).T; where they are rounded to int16 or int8, one scale per row and 256 k, each
    output moves by at most half a step of that rounding per term, no more (VNNI's int8 goes
    in offset to unsigned: the offset's share comes back out exactly; its panels take int16
    activations for steps of up to int8_i16_rows rows, read from the same layout)."""
    kernels = load_cpu_decode()
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    q, scales = quantize_int8(torch.randn(n, k, generator=gen))
    got = kernels.PanelGemv(q, scales, activation_bits=bits).forward(x)
    w = q.float() * scales[:, None]
    want = x.float() @ w.T
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    atol = 2e-6 * k
    if bits == 8 and rows <= kernels.int8_i16_rows:
        bits = 16
    if bits:
        stretch_max = torch.cat(
            [c.abs().amax(dim=1, keepdim=True).expand_as(c) for c in x.float().split(256, dim=1)],
            dim=1,
        )
        act_max = 2 ** (bits - 1) - 1  # 32767 or 127
        half_step = stretch_max / act_max / 2  # [rows, k]
        rounding = half_step @ w.abs().T  # [rows, n]: the worst case of every term at once
        assert (got - want).abs().le(rounding * 1.01 + atol).all()
        # and not merely inside the worst case: the typical error is far below it (random
        # rounding errors add as a random walk: ~ the worst case / sqrt(k) and smaller)
        typical = {16: 1e-4, 8: 2e-2}[bits]
        assert ((got - want).norm() / want.norm()).item() < typical
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)


@needs_decode_kernel
@pytest.mark.parametrize("bits", _activation_bits())
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_panels_keep_massive_activations_out_of_the_rounding(bits, rows) -> None:
    """LLM residual streams carry a few dimensions hundreds of times the rest (massive
    activations); with int8 activations one of them would set the rounding step of the
    255 other values of its 256-k stretch. Values past 6x the stretch's root mean square are
    added in fp32 instead: every output stays within the rounding bound of the stretch's
    other values -- 1, 2 and 3 outliers in a stretch, at either sign, one at the last k, 3
    in a short last stretch (88 k: there the first limit, 6x the root mean square of all,
    lets two through and is narrowed)."""
    kernels = load_cpu_decode()
    n, k = 70, 600
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    for col, value in [(3, 400.0), (300, -250.0), (310, 180.0), (520, 90.0), (530, -300.0)]:
        x[:, col] = value  # one outlier in the first stretch, two in the second, ...
    x[:, k - 1] = 500.0  # ... and three in the last (a short one: 88 k)
    x = x.bfloat16()
    q, scales = quantize_int8(torch.randn(n, k, generator=gen))
    got = kernels.PanelGemv(q, scales, activation_bits=bits).forward(x)
    w = q.float() * scales[:, None]
    want = x.float() @ w.T
    if not bits:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * k)
        return
    stretches = []
    for c in x.float().split(256, dim=1):
        inliers = c.abs() <= 50  # the planted values are the outliers, all of them
        if bits == 16:  # int16 activations need no split
            inliers = torch.ones_like(inliers)
        stretches.append((c.abs() * inliers).amax(dim=1, keepdim=True).expand_as(c))
    half_step = torch.cat(stretches, dim=1) / (2 ** (bits - 1) - 1) / 2
    rounding = half_step @ w.abs().T
    assert (got - want).abs().le(rounding * 1.01 + 2e-6 * k * x.float().abs().max()).all()


def _amx_int8() -> bool:
    kernels = load_cpu_decode()
    return kernels is not None and bool(getattr(kernels, "amx_int8_usable", lambda: False)())


@needs_decode_kernel
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 16, 17, 40])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (48, 320), (96, 768), (32, 2048)])
def test_int8_tiles_give_the_panels_result_bit_for_bit(rows, n, k) -> None:
    """The AMX-INT8 GEMV (engine/kernels/amx_gemv.h) splits each int16 activation into a
    signed high and an unsigned low byte and sums both against the weights in int32: the same
    integers the panels' int16 dot product sums, so the same floats. Shapes: one 64-k block, a
    short last 256-k stretch (320), the bench's K (768, 2048); 1 and 2 live weight tiles; row
    groups of 16 and their balanced split past 16. Activations with an outlier column, rows of
    zeros and the extremes of the int16 range (x = -32767: high byte -128, low byte 1)."""
    kernels = load_cpu_decode()
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    q, scales = quantize_int8(torch.randn(n, k, generator=gen))
    if not _amx_int8():
        with pytest.raises(RuntimeError, match=r"AMX|native-bf16"):
            kernels.TileGemv(q, scales)
        pytest.skip("no AMX-INT8 here: int8 keeps its panels")
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[:, 3] = 300.0  # one column sets every row's first stretch scale
    x[0, 7] = -301.0  # the stretch's largest |x| negative: -32767 after rounding
    if rows > 2:
        x[1] = 0  # a zero row: scale 0
    want = kernels.PanelGemv(q, scales, activation_bits=16).forward(x)
    got = kernels.TileGemv(q, scales).forward(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.equal(got, want)


def test_int8_tiles_refuse_what_they_cannot_hold() -> None:
    if not _amx_int8():
        pytest.skip("no AMX-INT8 here")
    kernels = load_cpu_decode()
    q, scales = quantize_int8(torch.randn(32, 96))
    with pytest.raises(RuntimeError, match="K of 64"):
        kernels.TileGemv(q, scales)
    with pytest.raises(RuntimeError, match="scales"):
        kernels.TileGemv(quantize_int8(torch.randn(32, 64))[0], None)
    tiles = kernels.TileGemv(*quantize_int8(torch.randn(32, 64)))
    with pytest.raises(RuntimeError, match=r"x: \[M >= 1, K\]"):
        tiles.forward(torch.ones(2, 32))


@pytest.fixture(scope="module")
def bf16_int8(tiny_qwen2_vl):
    return LLM(
        str(tiny_qwen2_vl),
        dtype="bfloat16",
        device="cpu",
        quantization="int8",
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
    )


@needs_decode_kernel
def test_fused_int8_step_logits_match_the_eager_int8_path(bf16_int8) -> None:
    """Every decode step of 1..5 rows run both ways: the fused kernel and the eager path
    (Int8Linear's GEMV, per-op norms, SDPA) compute the same products with the same
    roundings, so the logits differ by fp32 summation order and the bf16 roundings it flips:
    measured at most 1.2 % of the largest logit (mean 0.25 %), the same as bf16 weights'
    fused-against-eager difference (1.9 %, 0.3 %; their test allows 6 %). Where the fused
    step also rounds the activations to int8 (AVX2, AVX-512 VNNI without AMX; one scale per
    row and 256 k) the difference is that rounding's, bounded at 5 % / 1 % (measured at
    worst: 2.7 % / 0.56 % on a Zen 3, 2.9 % / 0.56 % on a Zen 4)."""
    from tests.engine.test_cpu_decode_kernel import _LogitsPairs

    int8_acts = load_cpu_decode().int8_activation_bits == 8
    max_rel, mean_rel = (0.05, 0.01) if int8_acts else (0.03, 0.005)

    runner = bf16_int8.engine.runner
    assert runner.fused_decoder is not None and bf16_int8.engine.model.decode_kernel_scales
    pairs = _LogitsPairs(bf16_int8)
    bf16_int8.chat(PROMPTS, GREEDY)
    bf16_int8.chat(PROMPTS[:1], GREEDY)
    assert {fused.shape[0] for fused, _ in pairs.pairs} >= {1, 5}
    for fused, eager in pairs.pairs:
        scale, diff = eager.abs().max().item(), (fused - eager).abs()
        assert diff.max().item() <= max_rel * scale, f"max |fused - eager| {diff.max():.4f}"
        assert diff.mean().item() <= mean_rel * scale, f"mean |fused - eager| {diff.mean():.4f}"
        # the same token wherever the eager top two lie further apart than that noise (a
        # near-tie may go either way: seen on an AMX CPU, whose prompts attend through torch)
        top2 = eager.topk(2, dim=-1).values
        confident = (top2[:, 0] - top2[:, 1]) > 2 * diff.max(dim=-1).values
        assert torch.equal(fused.argmax(-1)[confident], eager.argmax(-1)[confident])
    runner._forward_and_sample = pairs._forward


def assert_same_up_to_near_ties(want, got: list[list[int]], margin: float = 0.25) -> None:
    """``got`` repeats ``want``'s greedy tokens (outputs with logprobs=2) up to the first
    place where want's best two logits lay within ``margin`` (two bf16 steps of this
    checkpoint's ~16-32 logits): there another path's roundings may take the other one."""
    for w, g in zip(want, got, strict=True):
        assert len(g) == len(w.token_ids)
        pairs = zip(w.token_ids, g, strict=True)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if first is not None:
            (_, best), (_, second) = w.logprobs[first].top[:2]
            assert best - second <= margin, f"token {first} changed at a margin of {best - second}"


@needs_decode_kernel
def test_fused_int8_greedy_tokens_equal_the_eager_int8_path(bf16_int8) -> None:
    """Same tokens but for near-ties: the fused step rounds activations to int16 or int8 (one
    scale per 256 k) where the eager GEMV widens them, and prompt chunks past 16 rows run bf16
    products in both."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    runner = bf16_int8.engine.runner
    before = runner.fused_decode_steps
    fused = [o.outputs[0] for o in bf16_int8.chat(PROMPTS, params)]
    assert runner.fused_decode_steps > before
    decoder, runner.fused_decoder = runner.fused_decoder, None
    try:
        eager = [o.outputs[0].token_ids for o in bf16_int8.chat(PROMPTS, params)]
    finally:
        runner.fused_decoder = decoder
    assert_same_up_to_near_ties(fused, eager)
    assert sum(f.token_ids == e for f, e in zip(fused, eager, strict=True)) >= len(PROMPTS) // 2


@needs_decode_kernel
def test_fused_int8_with_chunked_prefill_and_preemption(tiny_qwen2_vl) -> None:
    """A KV pool too small for all requests (preemption, recompute) and 16-token prompt
    chunks: the int8 fused step serves the decodes, every request finishes, every block comes
    back, and the tokens are the roomy run's up to a near-tie: recomputed keys are bf16
    products of another path, so where the roomy run's best two logits lay within two bf16
    steps (this checkpoint's logits are ~16-32: a step is 0.125) a sequence may take the
    other one, and nowhere else."""
    convs = [text_conv(f"request number {i}: describe the scene " * (1 + i % 3)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    kw = {"dtype": "bfloat16", "device": "cpu", "quantization": "int8", "block_size": 4}
    roomy = LLM(str(tiny_qwen2_vl), **kw)
    want = [o.outputs[0] for o in roomy.chat(convs, params)]
    tight = LLM(str(tiny_qwen2_vl), num_kv_blocks=40, max_num_batched_tokens=16, **kw)
    got = [o.outputs[0].token_ids for o in tight.chat(convs, params)]
    stats = tight.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0
    assert tight.engine.runner.fused_decode_steps > 0
    assert_same_up_to_near_ties(want, got)


@needs_decode_kernel
def test_int8_decode_steps_on_amx_tiles_equal_the_panels(bf16_int8) -> None:
    """Where the plan puts the GEMV on AMX tiles (AMX CPUs), an int8 model's steps of 5 or
    more rows run the int8 tiles and fewer rows the panels; every step of a run replayed with
    the tiles off gives the same logits bit for bit. Elsewhere the plan keeps the panels."""
    from tests.engine.test_cpu_decode_kernel import _RecordingDecoder

    runner = bf16_int8.engine.runner
    decoder = runner.fused_decoder
    plan = bf16_int8.engine.platform
    assert runner.gemv_amx_tiles == plan.gemv_amx_tiles
    # the plan states the activation precision the kernel module chose on this machine
    kernels = load_cpu_decode()
    bits = kernels.int8_activation_bits
    assert plan.int8_activation_bits == bits and f"int8_act_bits={bits}" in plan.describe()
    i16_rows = kernels.int8_i16_rows if bits == 8 else 0
    assert plan.int8_i16_rows == i16_rows
    if not _amx_int8():
        assert not decoder.amx_gemv
        pytest.skip("no AMX-INT8 here: the panels")
    assert plan.gemv_amx_tiles and decoder.amx_gemv and "gemv=amx-tiles" in plan.describe()
    recorder = _RecordingDecoder(decoder)
    runner.fused_decoder = recorder
    try:
        convs = [text_conv("hello " * (i + 3)) for i in range(8)]
        bf16_int8.chat(convs, GREEDY)
        bf16_int8.chat(convs[:3], GREEDY)
    finally:
        runner.fused_decoder = decoder
    rows = {args[0].shape[0] for args, _, _ in recorder.calls}
    assert {3, 8} <= rows, rows
    decoder.set_amx_gemv(False)
    try:
        for args, kwargs, tiled in recorder.calls:
            assert torch.equal(decoder.forward(*args, **kwargs), tiled)
    finally:
        assert decoder.set_amx_gemv(True)
