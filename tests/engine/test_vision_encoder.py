"""Our vision tower forward: same embeddings as ``transformers``, however the job is split."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.linear import PackedLinear
from engine.models import load_model, vision_compute_dtype
from engine.models.vision_encoder import (
    MIN_SPLIT_ROWS,
    TYPICAL_ITEM_ROWS,
    AttentionCall,
    VisionTower,
    attention_calls,
)
from tests.engine.helpers import hf_greedy, image_conv, noise_image, truncate_at_eos

ATOL = 1e-5
# (t, h, w) in patches; h and w even (2x2 merge). 6x10 is not a whole number of tiny
# Qwen2.5-VL windows (4x4 patches), so edge windows are cut short.
ONE_IMAGE = [[1, 6, 10]]
TWO_IMAGES = [[1, 6, 10], [1, 4, 4]]


@pytest.fixture(scope="module")
def loaded(checkpoint_factory):
    cache: dict = {}

    def get(path):
        if path not in cache:
            cache[path] = load_model(path, torch.float32, torch.device("cpu"))
        return cache[path]

    return get


def _inputs(model, grids: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids)
    width = model.visual.patch_embed.proj.weight[0].numel()
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(-1).sum()), width, generator=gen), grid


def _tower(loaded, checkpoint, max_rows: int | None = None) -> tuple[VisionTower, object]:
    model, hf_config, arch = loaded(checkpoint)
    return VisionTower(model.visual, hf_config.vision_config, arch, max_rows), model


def _hf_tower(model, pixels, grid) -> list[torch.Tensor]:
    with torch.inference_mode():
        merged = model.visual(pixels, grid_thw=grid).pooler_output
    return list(torch.split(merged, (grid.prod(-1) // 4).tolist()))


def _assert_all_close(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert [t.shape for t in ours] == [t.shape for t in ref]
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("grids", [ONE_IMAGE, TWO_IMAGES], ids=["one", "two"])
@pytest.mark.parametrize("max_rows", [None, 7], ids=["whole", "rows7"])
def test_encode_equals_transformers_tower(loaded, tiny_checkpoint, grids, max_rows):
    tower, model = _tower(loaded, tiny_checkpoint, max_rows)
    pixels, grid = _inputs(model, grids)
    _assert_all_close(tower.encode(pixels, grid), _hf_tower(model, pixels, grid))


@pytest.mark.parametrize("max_rows", [1, 3, 16, 50, 10_000])
@pytest.mark.parametrize("budget", [0.0, 2.0, 25.0, float("inf")])
def test_any_split_gives_the_one_shot_result(loaded, tiny_checkpoint, max_rows, budget):
    tower, model = _tower(loaded, tiny_checkpoint, max_rows)
    pixels, grid = _inputs(model, TWO_IMAGES, seed=1)
    job = tower.job(pixels, grid)
    while not job.done():
        job.advance(budget)
    whole = VisionTower(model.visual, model.vision_config, model.architecture)
    _assert_all_close(job.result(), whole.encode(pixels, grid))


@pytest.mark.parametrize("max_rows", [1, 5, None])
def test_advance_stays_within_budget_and_drains_cost(loaded, tiny_checkpoint, max_rows):
    tower, model = _tower(loaded, tiny_checkpoint, max_rows)
    pixels, grid = _inputs(model, TWO_IMAGES)
    job = tower.job(pixels, grid)
    budget = job.total_cost / 13
    remaining, total_spent = job.remaining_cost, 0.0
    assert remaining == job.total_cost > 0
    while not job.done():
        item = job.items[job.cursor]
        spent = job.advance(budget)
        assert spent > 0
        # over budget only by the guaranteed first piece: the next item cut to its minimum,
        # or whole when cutting it would leave a piece under MIN_SPLIT_ROWS rows
        if spent > budget * (1 + 1e-9):
            rows = item.end - item.start
            share = 1.0 if rows < 2 * MIN_SPLIT_ROWS else min(1.0, 1.5 * MIN_SPLIT_ROWS / rows)
            assert spent <= item.cost * share + 1e-6
        assert job.remaining_cost == pytest.approx(remaining - spent)
        remaining, total_spent = job.remaining_cost, total_spent + spent
    assert job.remaining_cost == 0.0
    assert total_spent == pytest.approx(job.total_cost)


def test_zero_budget_still_makes_progress(loaded, tiny_qwen2_vl):
    tower, model = _tower(loaded, tiny_qwen2_vl, max_rows=4)
    job = tower.job(*_inputs(model, ONE_IMAGE))
    first = job.next_cost()
    spent = job.advance(0.0)
    assert 0 < spent <= first
    assert job.remaining_cost == pytest.approx(job.total_cost - spent)


def test_an_item_larger_than_the_budget_is_cut_to_fit(loaded, tiny_qwen2_vl):
    """Whole-stage items, a budget of a third of one: each step runs about that much, not the
    whole item (a step beside chat decodes must not overrun its time)."""
    tower, model = _tower(loaded, tiny_qwen2_vl, max_rows=None)
    pixels, grid = _inputs(model, ONE_IMAGE)
    job = tower.job(pixels, grid)
    while not job.done():
        item = job.items[job.cursor]
        budget = item.cost / 3
        spent = job.advance(budget)
        rows = item.end - item.start
        if rows >= 3 * MIN_SPLIT_ROWS:
            assert spent <= budget * (1 + 1e-9), item.kind
    whole = VisionTower(model.visual, model.vision_config, model.architecture)
    _assert_all_close(job.result(), whole.encode(pixels, grid))


def test_a_cut_never_leaves_a_piece_of_a_few_rows(loaded, tiny_qwen2_vl):
    """A piece of a few rows costs about what one of MIN_SPLIT_ROWS does (fixed per-item
    costs), so budgets that would cut an item just short of its end cut it earlier."""
    tower, model = _tower(loaded, tiny_qwen2_vl, max_rows=None)
    pixels, grid = _inputs(model, ONE_IMAGE)
    job = tower.job(pixels, grid)
    planned = {(i.kind, i.block): i.end - i.start for i in job.items}
    while not job.done():
        item = job.items[job.cursor]
        # a budget for all but 3 rows of the item: the old cut left a 3-row tail
        job.advance(job._item(item.kind, item.block, item.start, item.end - 3).cost)
    short = [i for i in job.items if i.end - i.start < MIN_SPLIT_ROWS]
    assert all(i.end - i.start == planned[(i.kind, i.block)] for i in short)  # never cut so
    assert len(job.items) > len(planned)  # items were cut
    whole = VisionTower(model.visual, model.vision_config, model.architecture)
    _assert_all_close(job.result(), whole.encode(pixels, grid))


def test_attention_is_cut_by_heads_before_rows(loaded, tiny_qwen2_vl):
    """A step with room for part of an attention item runs whole heads over all its rows
    (the rows of one head reuse its keys and values; a few rows of every head stream all
    of them), and cuts rows only within one head."""
    tower, model = _tower(loaded, tiny_qwen2_vl, max_rows=None)
    pixels, grid = _inputs(model, ONE_IMAGE)
    job = tower.job(pixels, grid)
    _advance_to_attention(job)
    item = job.items[job.cursor]
    heads = item.heads
    assert heads == (0, tower.num_heads) == (0, 2)
    rows = (item.start, item.end)
    # room for one head and a bit: one head, all rows
    assert job.advance(item.cost * 0.6) == pytest.approx(item.cost / 2)
    nxt = job.items[job.cursor]
    assert (nxt.kind, nxt.heads, (nxt.start, nxt.end)) == ("attn", (1, 2), rows)
    # room for a third of that head: its first rows only, the rest of the head next
    spent = job.advance(nxt.cost / 3)
    assert 0 < spent <= nxt.cost / 3 * (1 + 1e-9)
    rest = job.items[job.cursor]
    assert rest.heads == (1, 2) and rest.start > rows[0] and rest.end == rows[1]
    while not job.done():
        job.advance(job.next_cost() / 2)
    whole = VisionTower(model.visual, model.vision_config, model.architecture)
    _assert_all_close(job.result(), whole.encode(pixels, grid))


def test_attention_items_go_head_by_head_over_many_rows(loaded, tiny_qwen2_vl):
    """With items of ``max_rows`` rows, a block's attention is planned head-major: each item
    one head over ``max_rows x num_heads`` rows (the cost of an all-heads item), every item
    of head 0 before any of head 1, together covering each (row, head) once; a step with
    room for part of one runs that head's first rows, and the split encode is exact."""
    tower, model = _tower(loaded, tiny_qwen2_vl, max_rows=MIN_SPLIT_ROWS)
    pixels, grid = _inputs(model, ONE_IMAGE)
    job = tower.job(pixels, grid)
    rows = job.num_rows
    for block in range(tower.depth):
        attn = [i for i in job.items if i.kind == "attn" and i.block == block]
        assert all(i.heads[1] - i.heads[0] == 1 for i in attn)
        assert [i.heads[0] for i in attn] == sorted(i.heads[0] for i in attn)
        assert max(i.end - i.start for i in attn) == MIN_SPLIT_ROWS * tower.num_heads
        covered = sorted(
            (h, r) for i in attn for h in range(*i.heads) for r in range(i.start, i.end)
        )
        assert covered == [(h, r) for h in range(tower.num_heads) for r in range(rows)]
    _advance_to_attention(job)
    item = job.items[job.cursor]
    job.advance(item.cost / 2)
    piece, rest = job.items[job.cursor - 1], job.items[job.cursor]
    assert piece.heads == rest.heads == item.heads
    assert (piece.start, piece.end, rest.end) == (item.start, rest.start, item.end)
    while not job.done():
        job.advance(job.next_cost() / 2)
    whole = VisionTower(model.visual, model.vision_config, model.architecture)
    _assert_all_close(job.result(), whole.encode(pixels, grid))


def _advance_to_attention(job) -> None:
    while job.items[job.cursor].kind != "attn":
        job.advance(job.next_cost())


def test_each_item_run_is_charged_its_overhead(loaded, tiny_qwen2_vl):
    """``item_overhead``: with the budget for two items and an overhead worth one of them,
    only one runs; a first item too big for the budget minus its overhead is cut to fit."""
    tower, model = _tower(loaded, tiny_qwen2_vl, max_rows=4)
    inputs = _inputs(model, ONE_IMAGE)
    job = tower.job(*inputs)
    _advance_to_attention(job)
    first, second = job.items[job.cursor].cost, job.items[job.cursor + 1].cost
    before = job.items_run
    assert job.advance(first + second) == pytest.approx(first + second)
    assert job.items_run - before == 2

    job = tower.job(*inputs)
    _advance_to_attention(job)
    before = job.items_run
    assert job.advance(first + second, item_overhead=second) == pytest.approx(first)
    assert job.items_run - before == 1

    tower, model = _tower(loaded, tiny_qwen2_vl, max_rows=None)
    job = tower.job(*inputs)
    _advance_to_attention(job)
    item = job.items[job.cursor]
    assert item.end - item.start >= 3 * MIN_SPLIT_ROWS
    budget = item.cost * 0.75
    spent = job.advance(budget, item_overhead=item.cost * 0.25)
    assert spent <= budget - item.cost * 0.25 + 1e-6


def test_a_budget_covering_what_is_left_finishes_whatever_the_overhead(loaded, tiny_qwen2_vl):
    """The scheduler lets a chunk reach an image's tokens in the step whose grant covers the
    encode's remaining cost; overhead charged on top must not leave it unfinished (a server
    died on the missing embeddings)."""
    tower, model = _tower(loaded, tiny_qwen2_vl, max_rows=4)
    job = tower.job(*_inputs(model, ONE_IMAGE))
    job.advance(job.next_cost())
    job.advance(job.remaining_cost, item_overhead=job.total_cost)
    assert job.done()


def test_total_cost_does_not_depend_on_the_split(loaded, tiny_checkpoint):
    """The scheduler prices a job before choosing how to cut it."""
    pixels, grid = _inputs(loaded(tiny_checkpoint)[0], TWO_IMAGES)
    costs = [_tower(loaded, tiny_checkpoint, r)[0].job(pixels, grid).total_cost for r in (1, 7)]
    whole = _tower(loaded, tiny_checkpoint)[0].job(pixels, grid).total_cost
    assert costs == pytest.approx([whole, whole])


def test_cost_unit_is_one_per_patch_per_block_plus_attention(loaded, tiny_qwen2_vl):
    """Unit: the matmul FLOPs of one patch through one block; attention and merger on top."""
    tower, model = _tower(loaded, tiny_qwen2_vl)
    job = tower.job(*_inputs(model, ONE_IMAGE))
    patches = 60
    dense = sum(i.cost for i in job.items if i.kind in ("qkv", "attn", "mlp"))
    attention = tower.depth * 4 * patches * patches * tower.dim / tower.patch_block_flops
    assert dense == pytest.approx(tower.depth * patches + attention)


def test_result_before_done_is_an_error(loaded, tiny_qwen2_vl):
    tower, model = _tower(loaded, tiny_qwen2_vl, max_rows=8)
    job = tower.job(*_inputs(model, ONE_IMAGE))
    job.advance(0.0)
    with pytest.raises(RuntimeError, match="not done"):
        job.result()


def test_vision_linears_are_laid_out_for_work_item_rows(tiny_qwen2_vl):
    """The tower's packed linears are laid out for its work items' rows, not for one row:
    at one row an fp32 weight stays row-major (AVX2 and AVX-512 alike) and every item
    re-blocks it."""
    model = load_model(tiny_qwen2_vl, torch.bfloat16, torch.device("cpu"))[0]
    packed = [m for m in model.visual.modules() if isinstance(m, PackedLinear)]
    if not packed:
        pytest.skip("this CPU's plan keeps the tower's linears unpacked")
    assert {m.rows_hint for m in packed} == {TYPICAL_ITEM_ROWS}
    decoder = [m for m in model.modules() if isinstance(m, PackedLinear) and m not in packed]
    assert {m.rows_hint for m in decoder} <= {1}  # the decoder's stay laid out for decode


def _load_with_bf16_tower(checkpoint):
    """A bf16 model whose tower is bf16 too, whatever this CPU would pick for it (plain
    linears: a packed weight would keep its dtype)."""
    model, hf_config, arch = load_model(
        checkpoint, torch.bfloat16, torch.device("cpu"), pack_cpu_weights=False, cpu_kernels=False
    )
    for param in model.visual.parameters():
        param.data = param.data.bfloat16()
    return model, hf_config, arch


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_bf16_model_tower_runs_in_fp32_where_bf16_is_emulated(
    tiny_checkpoint, monkeypatch, fast_bf16
):
    monkeypatch.setattr("engine.platform.cpu_has_fast_bf16", lambda: fast_bf16)
    cpu = torch.device("cpu")
    model = load_model(
        tiny_checkpoint, torch.bfloat16, cpu, cpu_kernels=False, pack_cpu_weights=False
    )[0]
    want = torch.bfloat16 if fast_bf16 else torch.float32
    assert vision_compute_dtype(torch.bfloat16, torch.device("cpu")) == want
    assert {p.dtype for p in model.visual.parameters()} == {want}
    assert vision_compute_dtype(torch.float32, torch.device("cpu")) == torch.float32
    assert vision_compute_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16


def test_bf16_is_as_close_to_fp32_as_the_transformers_tower(checkpoint_factory, tiny_checkpoint):
    model, hf_config, arch = _load_with_bf16_tower(tiny_checkpoint)
    ref_model = load_model(tiny_checkpoint, torch.float32, torch.device("cpu"))[0]
    pixels, grid = _inputs(model, TWO_IMAGES)
    ref = torch.cat(_hf_tower(ref_model, pixels, grid))
    ours = torch.cat(
        VisionTower(model.visual, hf_config.vision_config, arch, 7).encode(pixels, grid)
    )
    theirs = torch.cat(_hf_tower(model, pixels.bfloat16(), grid))
    assert ours.dtype == torch.bfloat16
    ours_err = (ours.float() - ref).abs().max().item()
    theirs_err = (theirs.float() - ref).abs().max().item()
    assert ours_err <= 2 * theirs_err + 1e-2


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut"])
@pytest.mark.parametrize("max_rows", [None, 37])
def test_bf16_matmul_attention_matches_the_fused_kernel(tiny_checkpoint, max_rows, cut):
    """The CPU bf16 path (two bmm per 64 query rows over head-major k/v) against SDPA, on an
    image of 240 patches so the row loop and the per-block k/v copy both come into play."""
    model, hf_config, arch = _load_with_bf16_tower(tiny_checkpoint)
    tower = VisionTower(model.visual, hf_config.vision_config, arch, max_rows)
    pixels, grid = _inputs(model, [[1, 12, 20], [1, 4, 6]], seed=3)

    def run(matmuls: bool) -> torch.Tensor:
        job = tower.job(pixels, grid)
        assert job._matmul_attention  # bf16 on CPU takes the matmul path by default
        job._matmul_attention = matmuls
        return _encode_to_end(job, cut)

    _assert_matches_sdpa(run(True), run(False))


def _encode_to_end(job, cut: bool = False) -> torch.Tensor:
    """The job run to completion: whole items, or (``cut``) each step a third of the next
    item, which cuts attention by heads and then by rows (the paths slice heads)."""
    while not job.done():
        job.advance(job.next_cost() / 3 if cut else float("inf"))
    return torch.cat(job.result()).float()


def _assert_matches_sdpa(ours: torch.Tensor, sdpa: torch.Tensor) -> None:
    cosine = torch.nn.functional.cosine_similarity(ours.flatten(), sdpa.flatten(), dim=0)
    assert cosine > 0.9999
    assert (ours - sdpa).abs().max() <= 0.02 * sdpa.abs().max()


def test_attention_calls_batch_whole_equal_windows_and_cut_the_edges():
    windows = [(0, 4), (4, 8), (8, 12), (12, 14), (14, 18)]
    assert attention_calls(windows, 0, 18) == [
        AttentionCall(0, 12, 0, 12, 3),
        AttentionCall(12, 14, 12, 14, 1),
        AttentionCall(14, 18, 14, 18, 1),
    ]
    # a row range cutting windows: the cut windows keep all their keys
    assert attention_calls(windows, 2, 13) == [
        AttentionCall(2, 4, 0, 4, 1),
        AttentionCall(4, 12, 4, 12, 2),
        AttentionCall(12, 13, 12, 14, 1),
    ]


def test_engine_greedy_tokens_unchanged_by_our_tower(tiny_checkpoint):
    conv = image_conv(
        "Compare the two frames.", noise_image(112, 84, seed=4), noise_image(140, 112, seed=5)
    )
    params = SamplingParams(temperature=0.0, max_tokens=16)
    tokens = {}
    for impl in ("engine", "hf"):
        llm = LLM(str(tiny_checkpoint), dtype="float32", max_num_batched_tokens=64)
        llm.engine.model.vision_impl = impl
        tokens[impl] = llm.chat(conv, params)[0].outputs[0].token_ids
        eos = llm.engine.eos_token_ids
    assert tokens["engine"] == tokens["hf"]
    assert tokens["engine"] == truncate_at_eos(hf_greedy(tiny_checkpoint, conv, 16), eos)


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut"])
@pytest.mark.parametrize("tower_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_rows", [None, 37])
def test_native_flash_attention_matches_the_fused_kernel(
    tiny_checkpoint, max_rows, tower_dtype, cut
):
    """engine/kernels' flash attention (packed k/v reused across work items and, for
    Qwen2.5-VL, one call per window) against SDPA on the same tower: bf16, and fp32 (a bf16
    model's tower where bf16 is emulated; the native build rounds it to bf16)."""
    from engine.kernels import load_cpu_decode

    kernels = load_cpu_decode()
    if kernels is None:
        pytest.skip("needs AVX2 or AVX-512 and a C++ compiler")
    model, hf_config, arch = _load_with_bf16_tower(tiny_checkpoint)
    for param in model.visual.parameters():
        param.data = param.data.to(tower_dtype)
    pixels, grid = _inputs(model, [[1, 12, 20], [1, 4, 6]], seed=3)

    def run(native: bool) -> torch.Tensor:
        tower = VisionTower(
            model.visual,
            hf_config.vision_config,
            arch,
            max_rows,
            kernels=kernels if native else None,
        )
        job = tower.job(pixels, grid)
        assert job._native == native
        job._matmul_attention = native  # off: SDPA, the reference
        return _encode_to_end(job, cut)

    _assert_matches_sdpa(run(True), run(False))


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut"])
def test_torch_flash_plan_takes_sdpa_over_the_kernels_and_the_matmuls(tiny_checkpoint, cut):
    """AMX CPUs (the platform plan's ``torch_flash_attention``): the tower attends through
    torch's flash kernel even where engine.kernels is built, and agrees with the native
    kernel's result."""
    from engine.kernels import load_cpu_decode

    kernels = load_cpu_decode()
    model, hf_config, arch = _load_with_bf16_tower(tiny_checkpoint)
    pixels, grid = _inputs(model, [[1, 12, 20], [1, 4, 6]], seed=3)

    def run(torch_flash: bool) -> torch.Tensor:
        tower = VisionTower(
            model.visual, hf_config.vision_config, arch, 37, kernels, torch_flash=torch_flash
        )
        job = tower.job(pixels, grid)
        assert not job._native if torch_flash else job._native == (kernels is not None)
        assert job._matmul_attention != torch_flash
        return _encode_to_end(job, cut)

    _assert_matches_sdpa(run(False), run(True))


@pytest.mark.parametrize("fraction", [0.13, 0.37, 0.61, 0.83])
def test_a_cut_takes_the_most_rows_that_fit(loaded, tiny_checkpoint, fraction):
    """Every cut piece is the largest run of rows within the budget (more would not fit),
    whether its price is linear in the rows (computed directly) or uneven across them
    (Qwen2.5-VL's windows: searched), and the split encode equals the one-shot one."""
    tower, model = _tower(loaded, tiny_checkpoint, max_rows=None)
    pixels, grid = _inputs(model, [[1, 12, 20]])
    job = tower.job(pixels, grid)
    cuts = 0
    while not job.done():
        item = job.items[job.cursor]
        budget = item.cost * fraction
        job.advance(budget)
        piece = job.items[job.cursor - 1]
        if (piece.start, piece.end) == (item.start, item.end):
            continue  # not cut by rows (too few, or whole heads)
        cuts += 1
        rows = piece.end - piece.start
        if rows > MIN_SPLIT_ROWS and item.end - piece.end > MIN_SPLIT_ROWS:
            assert piece.cost <= budget * (1 + 1e-9), piece.kind
            more = job._item(piece.kind, piece.block, piece.start, piece.end + 1, piece.heads)
            assert more.cost > budget, piece.kind
    assert cuts > 0
    whole = VisionTower(model.visual, model.vision_config, model.architecture)
    _assert_all_close(job.result(), whole.encode(pixels, grid))
