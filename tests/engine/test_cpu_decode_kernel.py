"""The fused bf16 CPU decode kernel (engine/kernels/cpu_decode.cpp) against the eager path.

Two bf16 implementations round differently, so tokens are not compared one for one (a near-tie
flips either way); the checks are that the kernel's logits are as close to the fp32 model's as
the eager bf16 path's are, and that every confident choice is the same.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import load_cpu_decode
from tests.engine.helpers import image_conv, noise_image, text_conv

kernels = load_cpu_decode()
pytestmark = pytest.mark.skipif(
    kernels is None, reason="needs AVX-512 or AVX2 and a C++ compiler (the engine falls back)"
)


def test_the_loaded_build_is_this_cpus_variant() -> None:
    from engine.kernels import cpu_variant

    variant = cpu_variant()
    assert kernels.isa == ("avx2" if variant == "avx2" else "avx512")
    assert kernels.bf16_dot == (variant == "native-bf16")
    # int8 panels: int16 activations where AMX-INT8 tiles share them, else int8 ones (VNNI's
    # vpdpbusd, vpmaddubsw on AVX2); widened to fp32 in the AVX-512 build without VNNI
    amx_int8 = kernels.amx_int8_usable()
    want_bits = {"native-bf16": 16 if amx_int8 else 8, "emulated-bf16-vnni": 8, "avx2": 8}
    assert kernels.int8_activation_bits == want_bits.get(variant, 0)
    vnni = [0, 8, 16]
    want_supported = {"native-bf16": vnni, "emulated-bf16-vnni": vnni, "avx2": [0, 8]}
    assert list(kernels.int8_activation_bits_supported) == want_supported.get(variant, [0])
    # VNNI builds: steps of up to 4 rows keep int16 activations against the int8 layout
    assert kernels.int8_i16_rows == (4 if variant in ("native-bf16", "emulated-bf16-vnni") else 0)


@pytest.mark.parametrize("rows", [*range(1, 9), 12, 16])
@pytest.mark.parametrize("k", [64, 200, 800])  # 200 and 800 leave a tail past the vector loop
def test_small_matmul_matches_fp32(rows: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(97, k, generator=gen).bfloat16()
    want = x.float() @ w.float().T
    got = kernels.small_matmul(x, w).float()
    # one bf16 rounding of the result, plus fp32 summation-order noise
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3 * k**0.5)


def _amx() -> bool:
    return bool(getattr(kernels, "amx_usable", lambda: False)())


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 16])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (80, 96), (1280, 768), (48, 2048)])
def test_tiled_matmul_matches_fp32(rows: int, n: int, k: int) -> None:
    """The GEMV on AMX tiles (engine/kernels/amx_gemv.h): one to four live output tiles, one
    k block and many, the bench decoder's shapes."""
    if not _amx():
        with pytest.raises(RuntimeError, match=r"AMX|native-bf16"):
            kernels.tiled_matmul(
                torch.ones(1, 32).bfloat16(), kernels.tile_matrix(torch.ones(16, 32).bfloat16())
            )
        return
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    tiles = kernels.tile_matrix(w)
    assert tiles.shape == (n // 16, k // 32, 16, 32)
    assert torch.equal(tiles[1 % (n // 16), 0, 3], w[16 * (1 % (n // 16)) + 3, :32])
    want = x.float() @ w.float().T
    got = kernels.tiled_matmul(x, tiles).float()
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3 * k**0.5)


def test_tiled_matmul_rejects_what_tiles_cannot_hold() -> None:
    if not kernels.bf16_dot:
        pytest.skip("AMX tiles are the native-bf16 build's")
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.tile_matrix(torch.ones(24, 64).bfloat16())
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.tile_matrix(torch.ones(32, 48).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.tile_matrix(torch.ones(32, 64))
    if _amx():
        tiles = kernels.tile_matrix(torch.ones(32, 64).bfloat16())
        with pytest.raises(RuntimeError, match=r"1\.\.16 rows"):
            kernels.tiled_matmul(torch.ones(17, 64).bfloat16(), tiles)
        with pytest.raises(RuntimeError, match="x shape"):
            kernels.tiled_matmul(torch.ones(2, 32).bfloat16(), tiles)


@pytest.mark.parametrize("rows", [1, 3, 5, 6, 7, 8, 9, 12, 13, 16])
@pytest.mark.parametrize(("n", "k"), [(32, 64), (45, 130), (97, 300)])
def test_panel_matmul_matches_fp32(rows: int, n: int, k: int) -> None:
    """The decode GEMV's bf16 panels (emulated builds: widened, AVX2 in blocks of up to 6
    rows per half panel; native: the bf16 dot product, blocks of up to 12 rows): a last panel
    short of 32 features, k pairs past one 64-pair chunk, full and partial row blocks and a
    last block of 1-2 rows over both halves."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    want = x.float() @ w.float().T
    got = kernels.panel_matmul(x, w).float()
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3 * k**0.5)


def _attention_fp32(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    n, m, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(group, 1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) * scale
    if causal:  # the queries are the last n of the m positions
        visible = torch.arange(m)[None, :] <= (m - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1)


@pytest.mark.parametrize(
    ("n", "m", "heads", "kv_heads", "head_dim", "causal"),
    [
        (5, 5, 2, 1, 16, True),  # tiny: one partial tile
        (37, 100, 4, 2, 64, True),  # a late chunk: 63 cached keys before its own
        (100, 100, 6, 6, 64, False),  # vision: full attention
        (33, 77, 4, 4, 80, False),  # Qwen2-VL's vision head size
        (130, 300, 12, 4, 128, True),  # several 64-key tiles, GQA, the LM head size
        (1, 9, 3, 1, 32, True),
    ],
)
@pytest.mark.parametrize("amx", [False, True], ids=["dot", "amx"])
def test_flash_attention_matches_fp32(n, m, heads, kv_heads, head_dim, causal, amx) -> None:
    """``amx``: the products on AMX tiles where the machine has them (head sizes a multiple
    of 32), the dot products elsewhere: the same result either way."""
    gen = torch.Generator().manual_seed(n * m + head_dim)
    q = torch.randn(n, heads, head_dim, generator=gen).bfloat16()
    k = torch.randn(m, kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(m, kv_heads, head_dim, generator=gen).bfloat16()
    scale = head_dim**-0.5
    want = _attention_fp32(q, k, v, scale, causal)
    got = kernels.flash_attention(q, k, v, scale, causal, amx).float()
    # probabilities go through bf16 for p.v (as in GPU flash attention), the output is bf16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)
    packed = kernels.pack_kv(k, v)  # the split API: pack once, attend many query blocks
    parts = [
        kernels.attend_packed(q[i : i + 16], packed, scale, False, amx) for i in range(0, n, 16)
    ]
    if not causal:
        assert torch.equal(torch.cat(parts), got.bfloat16())


@pytest.mark.parametrize("amx", [False, True], ids=["dot", "amx"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_with_a_late_dominant_key(causal: bool, amx: bool) -> None:
    """Tiles are exponentiated against a running max that may trail the true one; a key far
    above everything before it, several tiles in, must still rescale what came before."""
    gen = torch.Generator().manual_seed(11)
    n, m, heads, head_dim = 40, 300, 2, 64
    q = torch.randn(n, heads, head_dim, generator=gen)
    k = torch.randn(m, heads, head_dim, generator=gen)
    v = torch.randn(m, heads, head_dim, generator=gen)
    k[250] = q[-1] * 3  # a score ~ 3 * |q|^2 / 8, far past the others, in the fourth tile
    k[130] = q[-1] * 1.2  # and a milder jump in the third
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scale = head_dim**-0.5
    want = _attention_fp32(q, k, v, scale, causal)
    got = kernels.flash_attention(q, k, v, scale, causal, amx).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("n", "m", "heads", "kv_heads", "head_dim", "causal"),
    [
        (1, 100, 12, 4, 64, True),  # one row: 15 of the tile's 16 are padding
        (37, 1200, 12, 4, 64, True),  # a camera prompt's chunk, bench heads
        (300, 4800, 6, 6, 64, False),  # a vision piece against a 640x480 frame's keys
        (20, 333, 12, 2, 128, False),  # Qwen2-VL-2B's head size, a partial last tile
        (50, 50, 4, 4, 32, True),
    ],
)
def test_amx_attention_agrees_with_the_dot_product(n, m, heads, kv_heads, head_dim, causal):
    """On AMX the tiles' products equal the dot products' up to summation order; head sizes
    the tiles do not take (not a multiple of 32) stay on the dot products, bit for bit."""
    if not _amx():
        pytest.skip("no AMX here: the flag falls back to the dot products (tested above)")
    gen = torch.Generator().manual_seed(n + m)
    q = torch.randn(n, heads, head_dim, generator=gen).bfloat16()
    k = torch.randn(m, kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(m, kv_heads, head_dim, generator=gen).bfloat16()
    packed = kernels.pack_kv(k, v)
    scale = head_dim**-0.5
    dot = kernels.attend_packed(q, packed, scale, causal, False).float()
    tiles = kernels.attend_packed(q, packed, scale, causal, True).float()
    torch.testing.assert_close(tiles, dot, rtol=2e-2, atol=1e-2)
    if m >= 1000:  # the tiles ran: over this many keys the summation order shows somewhere
        assert not torch.equal(tiles, dot)
    odd = torch.randn(n, heads, 48, generator=gen).bfloat16()
    packed48 = kernels.pack_kv(
        torch.randn(m, kv_heads, 48).bfloat16(), torch.randn(m, kv_heads, 48).bfloat16()
    )
    assert torch.equal(
        kernels.attend_packed(odd, packed48, 0.1, causal, True),
        kernels.attend_packed(odd, packed48, 0.1, causal, False),
    )


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "head_dim"), [(1, 12, 4, 64), (5, 4, 2, 16)])
def test_paged_decode_attention_matches_fp32(rows, heads, kv_heads, head_dim) -> None:
    """Scattered blocks, contexts from 1 token to several splits' worth (split-K merge)."""
    gen = torch.Generator().manual_seed(rows)
    block_size, num_blocks = 16, 200
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).bfloat16()
    lens = [1, 700, 33, 129, 16][:rows]
    tables = torch.zeros(rows, 50, dtype=torch.long)
    perm = torch.randperm(num_blocks, generator=gen)
    used = 0
    for row, n in enumerate(lens):
        blocks = -(-n // block_size)
        tables[row, :blocks] = perm[used : used + blocks]
        used += blocks
    q = torch.randn(rows, heads, head_dim, generator=gen).bfloat16()
    scale = head_dim**-0.5
    got = kernels.decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(lens), block_size, scale
    ).float()
    for row, n in enumerate(lens):
        idx = torch.arange(n)
        slots = tables[row, idx // block_size] * block_size + idx % block_size
        want = _attention_fp32(q[row : row + 1], k_cache[slots], v_cache[slots], scale, False)
        torch.testing.assert_close(got[row : row + 1], want, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("n", "context", "heads", "kv_heads", "head_dim", "block_size"),
    [
        (16, 1200, 12, 4, 64, 16),
        (8, 8, 4, 2, 16, 4),
        (13, 77, 4, 4, 32, 4),
        (32, 300, 6, 2, 128, 16),
    ],
)
@pytest.mark.parametrize("amx", [False, True], ids=["dot", "amx"])
def test_chunk_attention_matches_fp32(
    n, context, heads, kv_heads, head_dim, block_size, amx
) -> None:
    """A prompt chunk's rows (the last n of ``context`` tokens, scattered blocks, causal) as
    the fused step attends them: packed from the paged cache and attended as one block (on
    AMX tiles with ``amx`` where the machine has them)."""
    gen = torch.Generator().manual_seed(n + context)
    num_blocks = context // block_size + 8
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).bfloat16()
    table = torch.randperm(num_blocks, generator=gen)
    q = torch.randn(n, heads, head_dim, generator=gen).bfloat16()
    scale = head_dim**-0.5
    got = kernels.chunk_attention(
        q, k_cache, v_cache, table, context, block_size, scale, amx
    ).float()
    idx = torch.arange(context)
    slots = table[idx // block_size] * block_size + idx % block_size
    want = _attention_fp32(q, k_cache[slots], v_cache[slots], scale, True)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)
    # and what the per-row decode kernel gives for the same rows
    lens = torch.arange(context - n + 1, context + 1)
    rows = kernels.decode_attention(
        q, k_cache, v_cache, table.expand(n, -1).contiguous(), lens, block_size, scale
    ).float()
    torch.testing.assert_close(got, rows, rtol=2e-2, atol=1e-2)


def test_chunk_attention_rejects_bad_shapes() -> None:
    cache = torch.zeros(64, 2, 32).bfloat16()
    table = torch.arange(4)
    with pytest.raises(RuntimeError, match="head shapes"):  # q's head size is not the cache's
        kernels.chunk_attention(torch.zeros(4, 4, 16).bfloat16(), cache, cache, table, 8, 16, 1.0)
    with pytest.raises(RuntimeError, match="context length"):  # more queries than tokens
        kernels.chunk_attention(torch.zeros(9, 4, 32).bfloat16(), cache, cache, table, 8, 16, 1.0)
    with pytest.raises(RuntimeError, match="context length"):  # past the block table
        kernels.chunk_attention(torch.zeros(4, 4, 32).bfloat16(), cache, cache, table, 65, 16, 1.0)


def test_flash_attention_rejects_bad_shapes() -> None:
    q = torch.randn(4, 2, 64).bfloat16()
    odd = torch.randn(4, 1, 24).bfloat16()
    with pytest.raises(RuntimeError, match="head_dim"):
        kernels.flash_attention(odd, odd, odd, 1.0, False)
    with pytest.raises(RuntimeError, match="causal"):
        kernels.flash_attention(q, q[:2], q[:2], 1.0, True)
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.flash_attention(q.float(), q, q, 1.0, False)


def _set_prefill_attention(llm: LLM, torch_flash: bool) -> None:
    """What the platform plan's ``torch_flash_attention`` sets at load, on any CPU."""
    model = llm.engine.model
    model.torch_flash_attention = torch_flash
    model.set_cpu_kernels(model.cpu_kernels)
    assert all(layer.self_attn.native_prefill != torch_flash for layer in model.layers)


@pytest.mark.parametrize("torch_flash", [False, True])
def test_native_prefill_attention_gives_the_same_tokens_chunked_or_not(
    tiny_checkpoint, torch_flash: bool
) -> None:
    """bf16 with the kernels: prompt chunks attend to cached prefixes through the flash
    kernel, ours or (AMX CPUs' plan) torch's; chunk sizes change no greedy token beyond bf16
    noise (compared on logits)."""
    convs = [
        image_conv("describe this picture in detail", noise_image(84, 56, 5)),
        text_conv("count the words in this sentence " * 12),
    ]
    params = SamplingParams(temperature=0, max_tokens=1)
    logits = {}
    for budget in (16, 64, 4096):
        llm = LLM(model=str(tiny_checkpoint), dtype="bfloat16", max_num_batched_tokens=budget)
        assert llm.engine.model.cpu_kernels is not None
        _set_prefill_attention(llm, torch_flash)
        logs = _capture_sampled_logits(llm)
        llm.chat(convs, params)
        logits[budget] = torch.cat(logs)
        # 16-token chunks fit the plan's fused prompt rows (16, or 1,024 over oneDNN's GEMM)
        if budget <= llm.engine.runner.fused_prefill_rows:
            assert llm.engine.runner.fused_prefill_steps > 0
    for budget in (16, 64):
        diff = (logits[budget] - logits[4096]).abs().max().item()
        assert diff <= 0.05 * logits[4096].abs().max().item()
        assert torch.equal(logits[budget].argmax(-1), logits[4096].argmax(-1))


def test_huge_page_copies_are_equal_and_independent() -> None:
    a, b = torch.randn(3, 5).bfloat16(), torch.arange(7, dtype=torch.bfloat16)
    ca, cb = kernels.copy_to_huge_pages([a, b])
    assert torch.equal(ca, a) and torch.equal(cb, b)
    a.zero_()
    assert not torch.equal(ca, a)


class _LogitsPairs:
    """Runs each fused-eligible step both ways and keeps (fused, eager) logits: decode-only
    steps, or (``prompt_steps``) steps with prompt tokens that fit the kernel's rows."""

    def __init__(self, llm: LLM, prompt_steps: bool = False) -> None:
        self.runner = llm.engine.runner
        self.prompt_steps = prompt_steps
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._forward = self.runner._forward_and_sample
        self._sample = self.runner._sample
        self.runner._forward_and_sample = self._both

    def _fused(self, chunks) -> torch.Tensor | None:
        runner = self.runner
        if not self.prompt_steps:
            applies = runner._fused_decode_applies(chunks)
            return runner._fused_decode_logits(chunks) if applies else None
        if runner._fused_decode_applies(chunks) or not runner._fused_prefill_applies(chunks):
            return None
        logits, sampled = runner._fused_step_logits(chunks)
        return logits if sampled else None

    def _both(self, sched, interrupt=None):
        runner = self.runner
        fused = self._fused(sched.chunks)
        if fused is None:
            return self._forward(sched, interrupt)
        seen: list[torch.Tensor] = []

        def keep(logits, chunks):
            seen.append(logits)
            return self._sample(logits, chunks)

        decoder, runner.fused_decoder, runner._sample = runner.fused_decoder, None, keep
        runner._native_attention = False  # the eager gather + SDPA decode attention
        try:
            out = self._forward(sched)  # eager: rewrites the same cache slots, then samples
        finally:
            runner.fused_decoder = decoder
            runner._native_attention = True
            del runner._sample
        self.pairs.append((fused, seen[0]))
        return out


def test_fused_decode_logits_match_eager(tiny_checkpoint) -> None:
    """Decode steps of 1..20 requests (text and image prompts, several KV blocks each): the
    kernel's own GEMV up to the plan's ``gemv_max_rows`` (4, or 16 where the native build
    prefetches weights), oneDNN's packed GEMM called from the kernel past that."""
    # a fixed token budget: whole prompts in one step, so all requests decode together
    llm = LLM(
        model=str(tiny_checkpoint),
        dtype="bfloat16",
        block_size=4,
        max_num_seqs=20,
        max_num_batched_tokens=4096,
    )
    runner = llm.engine.runner
    assert runner.fused_decoder is not None
    pairs = _LogitsPairs(llm)
    convs = [text_conv("hello " * (i + 1)) for i in range(16)]
    convs += [image_conv(f"what is in picture {i}?", noise_image(56, 56, i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.chat(convs, params)
    llm.chat(convs[:1], params)  # a single row as well
    llm.chat(convs[2:8], params)  # and middle sizes
    llm.chat(convs[:12], params)
    # long contexts: the kernel splits a row's keys across tasks and merges the partial softmaxes
    llm.chat([text_conv("word " * 600), text_conv("other words " * 200)], params)
    sizes = {fused.shape[0] for fused, _ in pairs.pairs}
    # 20 rows where the plan's kernel takes them (AVX2 builds stop at 16: eager past that)
    assert {n for n in (1, 6, 12, 20) if n <= runner.fused_decode_rows} <= sizes
    if runner.fused_decode_rows > runner.UNPACKED_MAX_ROWS:  # packed weights: both paths ran
        assert any(n <= runner.gemv_max_rows for n in sizes)
        assert any(n > runner.gemv_max_rows for n in sizes)
        # the switch the cost model prices (past_gemv) and the scheduler plans around
        assert runner.fused_gemv_rows == min(runner.gemv_max_rows, 16)
        assert llm.engine.scheduler.config.fused_gemv_rows == runner.fused_gemv_rows
    else:  # the GEMV takes every row: no switch
        assert runner.fused_gemv_rows == 0
    _assert_pairs_agree(pairs)


def test_the_native_weight_prefetch_changes_no_number(tiny_checkpoint, monkeypatch) -> None:
    """The native GEMV's software prefetch (the plan's ``weight_prefetch_bytes``) only asks
    for memory early: logits bit for bit equal with it off and at any distance. The distance
    is each decoder's own: a second engine in the process leaves the first one's alone. (The
    row-major kernel it serves is kept here whatever the plan says of this CPU.)"""
    import engine.platform as platform

    monkeypatch.setattr(platform, "gemv_row_major_needed", lambda prefetch, amx: True)
    llm = LLM(model=str(tiny_checkpoint), dtype="bfloat16", block_size=4, max_num_seqs=4)
    runner = llm.engine.runner
    if not getattr(kernels, "bf16_dot", False):
        pytest.skip("the emulated builds always prefetch (compiled in)")
    decoder = runner.fused_decoder
    assert decoder.weight_prefetch() == runner.weight_prefetch_bytes
    recorder = _RecordingDecoder(decoder)
    runner.fused_decoder = recorder
    convs = [text_conv("hello " * (i + 3)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.chat(convs, params)
    for bytes_ahead in (0, 64, 4096):
        decoder.set_weight_prefetch(bytes_ahead)
        for args, kwargs, out in recorder.calls:
            assert torch.equal(decoder.forward(*args, **kwargs), out)
    with pytest.raises(RuntimeError, match="prefetch distance"):
        decoder.set_weight_prefetch(-1)
    assert decoder.weight_prefetch() == 4096, "a refused distance changes nothing"

    runner.weight_prefetch_bytes = 2048
    other = runner._build_fused_decoder()
    assert (other.weight_prefetch(), decoder.weight_prefetch()) == (2048, 4096)


def test_the_amx_gemv_agrees_with_the_dot_product(tiny_checkpoint) -> None:
    """Where the plan puts the GEMV on AMX tiles, the decoder's logits are those of the
    dot-product GEMV up to summation order (every call of a run replayed with the tiles off),
    for steps of 1 to 16 rows; elsewhere the decoder refuses the tiles."""
    from engine.platform import plan_platform

    llm = LLM(model=str(tiny_checkpoint), dtype="bfloat16", block_size=4, max_num_seqs=16)
    runner = llm.engine.runner
    decoder = runner.fused_decoder
    assert runner.gemv_amx_tiles == llm.engine.platform.gemv_amx_tiles
    if not _amx():
        assert not decoder.amx_gemv and not decoder.set_amx_gemv(True)
        pytest.skip("no AMX here: the plan keeps the dot product")
    assert llm.engine.platform.gemv_amx_tiles and decoder.amx_gemv
    assert (
        "gemv=amx-tiles"
        in plan_platform(torch.device("cpu"), torch.bfloat16, quantization=None).describe()
    )
    recorder = _RecordingDecoder(decoder)
    runner.fused_decoder = recorder
    convs = [text_conv("hello " * (i + 3)) for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.chat(convs, params)
    llm.chat(convs[:5], params)
    rows = {args[0].shape[0] for args, _, _ in recorder.calls}
    assert {1, 5, 16} & rows, rows
    decoder.set_amx_gemv(False)
    for args, kwargs, tiled in recorder.calls:
        dot = decoder.forward(*args, **kwargs)
        torch.testing.assert_close(tiled, dot, rtol=0.05, atol=0.05 * dot.abs().max().item())
        assert (tiled.argmax(-1) == dot.argmax(-1)).float().mean() >= 0.9
    assert decoder.set_amx_gemv(True) and decoder.amx_gemv


def test_the_row_major_copy_goes_where_the_panels_take_one_row(tiny_checkpoint, monkeypatch):
    """The native build may let its row-major bf16 matrices go (a third of the weight memory
    it holds): every call of a run replayed afterwards gives the same logits -- bit for bit
    from 2 rows (the panels and oneDNN ran them before too), up to summation order at 1 row
    (the panels' sums against the row-major kernel's; the emulated builds, which drop it only
    where oneDNN packs bf16, up to more rows). The plan asks for it where the
    row-major kernel has no tuned prefetch and no AMX tiles read it; the decoder refuses where
    panels or oneDNN's packing are missing, and AMX tiles once the copy is gone."""
    import engine.platform as platform

    assert not platform.gemv_row_major_needed(0, False)
    assert platform.gemv_row_major_needed(4096, False) and platform.gemv_row_major_needed(0, True)
    planned = LLM(model=str(tiny_checkpoint), dtype="bfloat16", block_size=4, max_num_seqs=2)
    plan = planned.engine.platform
    held = planned.engine.runner.fused_decoder.row_major
    assert held == plan.gemv_row_major or not getattr(kernels, "bf16_dot", False)
    if not held:  # the model let its references go with the decoder's
        assert planned.engine.model.decode_kernel_weights_hp is None
    del planned

    monkeypatch.setattr(platform, "gemv_row_major_needed", lambda prefetch, amx: True)
    llm = LLM(model=str(tiny_checkpoint), dtype="bfloat16", block_size=4, max_num_seqs=20)
    runner = llm.engine.runner
    decoder = runner.fused_decoder
    assert decoder.row_major
    native = getattr(kernels, "bf16_dot", False)
    if runner.fused_gemv_rows == 0 or decoder.amx_gemv:
        assert not decoder.drop_row_major() and decoder.row_major
        pytest.skip("the row-major copy stays: no oneDNN packing (emulated bf16), or AMX tiles")
    recorder = _RecordingDecoder(decoder)
    runner.fused_decoder = recorder
    convs = [text_conv("hello " * (i + 3)) for i in range(20)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.chat(convs[:1], params)
    llm.chat(convs[:3], params)
    llm.chat(convs, params)  # past the GEMV's rows: oneDNN's packing
    rows = {args[0].shape[0] for args, _, _ in recorder.calls}
    assert {1, 3, 20} <= rows, rows
    assert decoder.drop_row_major() and not decoder.row_major
    assert decoder.drop_row_major(), "dropping twice is no error"
    assert not decoder.set_amx_gemv(True), "AMX tiles are laid out from the row-major copy"
    for args, kwargs, before in recorder.calls:
        after = decoder.forward(*args, **kwargs)
        if args[0].shape[0] > 1 and native:  # emulated builds' panels start at more rows
            assert torch.equal(after, before)
        else:
            scale = before.abs().max().item()
            assert (after - before).abs().max().item() <= 0.02 * scale
            assert torch.equal(after.argmax(-1), before.argmax(-1))


@pytest.mark.parametrize("rows", [3, 5, 12, 48, 300])
def test_fused_prompt_steps_match_eager(tiny_checkpoint, rows: int) -> None:
    """Steps carrying prompt chunks (image rows included) beside decodes run the fused kernel
    while their rows fit the platform plan's ``fused_prompt_rows``: each new token a row
    attending to its own context length, the chunk's keys stored before any row attends.
    Their logits are the eager path's. 3 and 5 rows: chunks of 2-5 rows beside decodes,
    which attend as a block (``kChunkRows``), as a camera's chunks beside chat mostly do.
    48 and 300 rows: oneDNN's packed GEMM inside the kernel, where the plan lets prompt
    steps that big in (bf16 arithmetic); 300 is past the decode-only limit (256) too."""
    llm = LLM(
        model=str(tiny_checkpoint), dtype="bfloat16", block_size=4, max_num_batched_tokens=rows
    )
    runner = llm.engine.runner
    if llm.engine.platform.linear_kind == "onednn-packed" and runner.fused_prompt_rows < rows:
        # the plan keeps long chunks eager here (AMX: torch's flash attention beats the
        # kernel's); the kernel's path is what other bf16 CPUs take, so it is tested anyway
        runner.fused_prompt_rows = rows
        llm.engine.scheduler.config.fused_prefill_rows = runner.fused_prefill_rows
    if runner.fused_prefill_rows < rows:
        assert rows > 16 and not llm.engine.platform.bf16_arithmetic
        pytest.skip(f"this CPU's plan runs prompt steps of {rows} rows eager")
    pairs = _LogitsPairs(llm, prompt_steps=True)
    convs = [image_conv("what is in this picture?", noise_image(56, 56, 3))]
    # prompts of several steps each at either budget
    convs += [
        text_conv("tell me a story about " + "cats " * ((5 * i + 3) * rows // 12)) for i in range(3)
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.chat(convs, params)
    assert runner.fused_prefill_steps >= 4 and len(pairs.pairs) >= 4
    _assert_pairs_agree(pairs)


class _RecordingDecoder:
    """The runner's fused decoder, its forward calls recorded (arguments and result)."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self.calls: list[tuple[tuple, dict, torch.Tensor]] = []

    def forward(self, *args, **kwargs):
        out = self.decoder.forward(*args, **kwargs)
        self.calls.append((args, kwargs, out))
        return out

    def __getattr__(self, name: str):
        return getattr(self.decoder, name)


def test_fused_prompt_steps_compute_only_the_sampled_rows_logits(tiny_checkpoint) -> None:
    """A prompt step asks the kernel for the logits of its sampling rows only (the lm_head
    over every prompt row was a third of a 16-row step); those rows are the ones a full
    forward computes, an empty list gives no rows and an out-of-range row is an error.
    "The ones" up to the lm_head's rounding to bf16: its GEMV sums a lone row in four chains
    and a block of rows in one each, so one logit in a thousand may differ by a bf16 ulp."""
    llm = LLM(model=str(tiny_checkpoint), dtype="bfloat16", block_size=4, max_num_batched_tokens=12)
    runner = llm.engine.runner
    recorder = _RecordingDecoder(runner.fused_decoder)
    runner.fused_decoder = recorder
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.chat([text_conv("tell me a story about " + "cats " * 9)], params)
    # forward(embeds, cos, sin, tables, lengths, block_size, logit_rows, context_keys)
    prompt_calls = [c for c in recorder.calls if len(c[0]) >= 7 and c[0][6] is not None]
    assert prompt_calls, "no prompt step ran fused"
    sampled = 0
    for args, _, out in prompt_calls:
        rows = args[6]
        full = recorder.decoder.forward(*args[:6])  # rewrites the same cache slots
        assert out.shape == (len(rows), full.shape[1])
        torch.testing.assert_close(out, full[rows], rtol=2**-7, atol=1e-6)
        sampled += len(rows)
    assert sampled >= 1  # the last chunk samples the first token
    args = prompt_calls[0][0]
    assert recorder.decoder.forward(*args[:6], torch.tensor([], dtype=torch.long)).shape[0] == 0
    with pytest.raises(RuntimeError, match="logit_rows"):
        recorder.decoder.forward(*args[:6], torch.tensor([args[0].shape[0]]))


def _assert_pairs_agree(pairs: _LogitsPairs) -> None:
    """Fused logits within bf16 noise of eager ones, and the same token wherever the eager
    top two are further apart than that noise."""
    for fused, eager in pairs.pairs:
        scale = eager.abs().max().item()
        diff = (fused - eager).abs()
        assert diff.max().item() <= 0.06 * scale
        top2 = eager.topk(2, dim=-1).values
        confident = (top2[:, 0] - top2[:, 1]) > 2 * diff.max(dim=-1).values
        assert torch.equal(fused.argmax(-1)[confident], eager.argmax(-1)[confident])


def test_fused_decode_is_as_close_to_fp32_as_eager_bf16(tiny_qwen2_vl) -> None:
    """The kernel's error against the fp32 model is the eager bf16 path's, not more."""
    prompts = [text_conv("tell me about cats " * 3), text_conv("a b c")]
    captured: dict[str, torch.Tensor] = {}
    first_tokens: list[int] = []
    for name, fused in (("fused", True), ("eager", False)):
        # whole prompts in one step: the last sampled step is the decode of both prompts
        llm = LLM(
            model=str(tiny_qwen2_vl),
            dtype="bfloat16",
            cpu_kernels=fused,
            max_num_batched_tokens=4096,
        )
        assert (llm.engine.runner.fused_decoder is not None) == fused
        logs = _capture_sampled_logits(llm)
        outs = llm.chat(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        captured[name] = logs[-1]  # the decode step after the prompts
        first_tokens = [o.outputs[0].token_ids[0] for o in outs]
    ref = LLM(model=str(tiny_qwen2_vl), dtype="float32")
    logs = _capture_sampled_logits(ref)
    outs = ref.chat(prompts, SamplingParams(temperature=0, max_tokens=1))
    logs.clear()
    ref.generate(
        [
            {"prompt_token_ids": [*o.prompt_token_ids, t]}
            for o, t in zip(outs, first_tokens, strict=True)
        ],
        SamplingParams(temperature=0, max_tokens=1),
    )
    fp32 = logs[-1]
    err_fused = (captured["fused"] - fp32).abs().mean().item()
    err_eager = (captured["eager"] - fp32).abs().mean().item()
    assert err_fused <= 1.5 * err_eager + 1e-3


def _capture_sampled_logits(llm: LLM) -> list[torch.Tensor]:
    runner = llm.engine.runner
    logs: list[torch.Tensor] = []
    sample = runner._sample

    def keep(logits, chunks):
        logs.append(logits.clone())
        return sample(logits, chunks)

    runner._sample = keep
    return logs


@pytest.fixture(scope="module")
def head32_checkpoint(tmp_path_factory):
    """The tiny checkpoint with heads of 32 (decoder and tower): the smallest head size the
    AMX attention takes (tiny's 16 stays on the dot products)."""
    import dataclasses

    import engine.checkpoints as checkpoints

    tiny = checkpoints.PRESET_SHAPES["tiny"]
    shapes = dataclasses.replace(
        tiny,
        hidden_size=128,
        intermediate_size=256,
        mrope_section=(4, 6, 6),
        vision_embed_dim=64,
        vision_intermediate_size=128,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(checkpoints.PRESET_SHAPES, "tiny-head32", shapes)
        mp.setattr(checkpoints, "PRESETS", (*checkpoints.PRESETS, "tiny-head32"))
        out = tmp_path_factory.mktemp("qwen2_vl-tiny-head32")
        return checkpoints.make_model("qwen2_vl", "tiny-head32", out, seed=0)


def test_the_plan_runs_prompt_and_vision_attention_on_amx_tiles(head32_checkpoint) -> None:
    """Where the plan puts attention on AMX tiles, every path is told so -- prompt chunks in
    the fused kernel (24-row chunks here), the layers for the eager path's long chunks, the
    vision tower -- and the greedy tokens of an image request are those of the dot products
    (a second engine, tiles turned off)."""
    conv = image_conv("Describe the frame.", noise_image(168, 112, seed=7))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def engine(tiles: bool) -> LLM:
        llm = LLM(model=str(head32_checkpoint), dtype="bfloat16", max_num_batched_tokens=24)
        model, runner = llm.engine.model, llm.engine.runner
        assert runner.amx_attention == llm.engine.platform.amx_attention
        if not tiles:
            assert not runner.fused_decoder.set_amx_attention(False)
            model.amx_attention = False
            model.set_cpu_kernels(model.cpu_kernels)  # the layers' flag and the tower anew
        return llm

    llm = engine(tiles=True)
    decoder, model = llm.engine.runner.fused_decoder, llm.engine.model
    if not _amx():
        assert not llm.engine.platform.amx_attention and not decoder.amx_attention
        pytest.skip("no AMX here: the plan keeps the dot products")
    assert decoder.amx_attention and "prefill_attention=amx-tiles" in llm.engine.platform.describe()
    assert all(layer.self_attn.amx for layer in model.layers)
    assert model.vision_tower(64).amx_attention
    with_tiles = llm.chat(conv, params)[0].outputs[0].token_ids
    without = engine(tiles=False).chat(conv, params)[0].outputs[0].token_ids
    agree = sum(a == b for a, b in zip(with_tiles, without, strict=True)) / len(without)
    assert agree >= 0.9, (with_tiles, without)
