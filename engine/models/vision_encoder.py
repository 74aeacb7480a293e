"""Our forward for the Qwen2-VL / Qwen2.5-VL vision towers, as a job advanced a bounded amount.

Why not just call the ``transformers`` tower: it encodes a whole image set in one call, so a
4096-patch camera frame lands inside a single engine step and every interactive stream sharing
that step stalls. Here the same math is cut into *work items* that the scheduler runs a few
at a time between decode steps:

    embed[rows] -> each block: qkv[rows]..., attn[rows, heads]..., mlp[rows]... -> merge[rows]...

Each item is exact, so any split gives the one-shot result: the tower's attention is
bidirectional and every query row of a block reads the block-input k/v (computed by that
block's qkv items before any of its attention items run); attention items write their rows'
output aside, and the ``mlp`` items (output projection, residual, MLP) update the residual
stream only after every attention item of the block has run.

Why attention and MLP are separate items: beside chat decodes a step has a few ms for camera
work, and a combined item cut to fit was a few dozen rows, whose five small matmuls ran at a
fraction of their speed (on a 2-core AVX2 EPYC, 16 rows of a 640x480 frame: 2.6 ms of matmuls
for 0.5 ms of FLOPs at full speed, beside 2.3 ms of attention). Apart, the attention piece is
cut to the heads that fit, and within one head to the rows that fit (one head's keys and values
serve many query rows; a few rows of every head stream them all for little arithmetic), and
the MLP piece, ~6x cheaper per row, covers several times as many rows.

The weights stay in the ``transformers`` module (``model.visual``); only the math is ours:
the Conv3d patch embedding is one matmul, attention is fused ``scaled_dot_product_attention``
per image (or per Qwen2.5-VL window, equal-length windows batched into one call).

Cost unit — *patch-block*: 1.0 is the matmul FLOPs of one patch through one vision block
(qkv + proj + MLP). Attention is charged by its own FLOPs in the same unit (queries x keys),
the patch embedding and the merger by theirs, so a job's cost is proportional to its FLOPs:
a whole image costs about ``patches * depth`` plus its attention. The scheduler maps the unit
to seconds with its step-cost model.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import ACT2FN

QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
# a work item cut to fit a step keeps at least this many rows (smaller pieces are all overhead)
MIN_SPLIT_ROWS = 16
# the rows a vision linear's call usually carries: pieces beside chat run ~64, whole items
# 256 (engine/layers/linear.py PackedLinear lays the weights out for it)
TYPICAL_ITEM_ROWS = 64
_SCORE_ROWS = 64  # query rows per score matrix in bf16 attention: [heads, 64, keys] stays cached


@dataclass(frozen=True)
class WorkItem:
    """One bounded piece of the encode: ``kind`` over rows ``[start, end)`` of block ``block``.

    Rows are patches, except for ``merge`` where they are merged tokens (groups of patches).
    """

    kind: str  # "embed" | "qkv" | "attn" | "mlp" | "merge"
    block: int  # -1 for embed and merge
    start: int
    end: int
    cost: float
    calls: tuple[AttentionCall, ...] = ()  # attn: planned once, priced and then run
    heads: tuple[int, int] = (0, 0)  # attn: the heads [h0, h1) it computes


@dataclass(frozen=True)
class AttentionCall:
    """One fused attention call: ``batch`` equal segments, queries [q0, q1) over keys [k0, k1).

    Several whole windows of one length are contiguous rows, so they batch as a view, no copy.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    batch: int


def attention_calls(segments: list[tuple[int, int]], start: int, end: int) -> list[AttentionCall]:
    """The calls that compute attention for query rows ``[start, end)``, in row order.

    ``segments`` are the sorted, contiguous attention groups (images or windows) covering all
    rows; a query row attends to every key of its own segment. A segment cut by the row range
    becomes a call of its own (its queries a subset, its keys all of it); runs of whole
    segments of equal length become one batched call.
    """
    first = bisect_right(segments, start, key=lambda seg: seg[0]) - 1
    calls: list[AttentionCall] = []
    for seg_start, seg_end in segments[first:]:
        if seg_start >= end:
            break
        q0, q1 = max(seg_start, start), min(seg_end, end)
        whole = q0 == seg_start and q1 == seg_end
        last = calls[-1] if calls else None
        if (
            whole
            and last is not None
            and last.q0 == last.k0
            and last.q1 == last.k1 == seg_start
            and (last.q1 - last.q0) // last.batch == seg_end - seg_start
        ):
            calls[-1] = AttentionCall(last.q0, q1, last.k0, q1, last.batch + 1)
        else:
            calls.append(AttentionCall(q0, q1, seg_start, seg_end, 1))
    return calls


def frame_segments(grid_thw: list[list[int]]) -> list[tuple[int, int]]:
    """Full-attention groups: each frame of each image attends within itself (``h * w`` rows)."""
    segments, offset = [], 0
    for t, h, w in grid_thw:
        for _ in range(t):
            segments.append((offset, offset + h * w))
            offset += h * w
    return segments


def position_ids(grid_thw: list[list[int]], merge: int) -> Tensor:
    """(row, col) of every patch, in the tower's order: merge blocks of ``merge x merge`` patches.

    The processor emits patches block-major so that the merger can fold each block into one
    token with a plain reshape; rope must see the same order.
    """
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        pos = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], -1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def window_order(
    grid_thw: list[list[int]], merge: int, window: int
) -> tuple[Tensor, list[tuple[int, int]]]:
    """Qwen2.5-VL windows: the merged-token permutation that makes windows contiguous, and them.

    A window is ``window x window`` merged tokens of one frame, tiled row-major from the
    top-left; windows at the right and bottom edges are cut short. Returns the permutation
    (new position -> old merged index) and the windows as patch-row ranges in the new order.
    """
    order, segments, base, offset = [], [], 0, 0
    unit = merge * merge
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        nh, nw = -(-gh // window), -(-gw // window)
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        index = F.pad(index, (0, nw * window - gw, 0, nh * window - gh), value=-1)
        index = index.view(t, nh, window, nw, window).permute(0, 1, 3, 2, 4)
        index = index.reshape(t * nh * nw, window * window)
        for row in index:
            kept = row[row >= 0]
            order.append(kept + base)
            segments.append((offset, offset + unit * len(kept)))
            offset += unit * len(kept)
        base += t * gh * gw
    return torch.cat(order), segments


def rms_or_layer_norm(module: nn.Module, x: Tensor) -> Tensor:
    """The tower's norm: LayerNorm (Qwen2-VL) or RMSNorm in fp32, cast back, then scaled."""
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return module.weight * xf.to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rope in fp32 (as the checkpoints were trained); cos/sin are half-width."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class VisionTower:
    """Our forward over the weights of a ``transformers`` Qwen2-VL / Qwen2.5-VL vision tower.

    A plain object, not an ``nn.Module``: it borrows the tower's modules (so dtype / device
    moves and weight loads of the model are seen) without registering their parameters twice.
    """

    def __init__(
        self,
        hf_tower: nn.Module,
        vision_config,
        architecture: str,
        max_rows_per_item: int | None = None,
        kernels=None,
        torch_flash: bool = False,
        amx_attention: bool = False,
    ) -> None:
        self.hf = hf_tower
        self.kernels = kernels  # engine.kernels: native flash attention for bf16 on CPU
        # torch's flash kernel for every attention call (the platform plan's choice on AMX
        # CPUs, where it runs bf16 in tiles): a 640x480 frame of the bench tower in 0.85 s
        # against 2.1 s with our kernel and 1.6 s with the two-matmul path (2-core AMX Xeon)
        self.torch_flash = torch_flash
        # the kernels' attention with its products on AMX tiles (the plan's choice on AMX
        # CPUs, over torch_flash): one head's 256 rows against a 640x480 frame's 4,800 keys
        # in 1.31 ms against 1.65 through torch's flash kernel (2-core AMX Xeon,
        # benchmarks.attention); the frame's prompt chunks gain more (2.4-2.8x)
        self.amx_attention = amx_attention
        self.windowed = architecture == QWEN2_5_VL
        self.merge = vision_config.spatial_merge_size
        self.merge_unit = self.merge**2
        self.num_heads = vision_config.num_heads
        attn = hf_tower.blocks[0].attn
        self.dim = attn.qkv.in_features
        self.head_dim = self.dim // self.num_heads
        self.depth = len(hf_tower.blocks)
        if self.windowed:
            self.full_blocks = set(vision_config.fullatt_block_indexes)
            self.window = vision_config.window_size // self.merge // vision_config.patch_size
        else:
            self.full_blocks = set(range(self.depth))
            self.window = 0
        self.act = ACT2FN[vision_config.hidden_act]
        self.max_rows_per_item = max_rows_per_item
        self.patch_block_flops = self._row_matmul_flops()

    def _row_matmul_flops(self) -> float:
        """FLOPs of one patch through one block's matmuls: the cost unit."""
        block = self.hf.blocks[0]
        linears = [block.attn.qkv, block.attn.proj, *_linears(block.mlp)]
        return float(sum(2 * lin.in_features * lin.out_features for lin in linears))

    @property
    def dtype(self) -> torch.dtype:  # the patch embedding is a convolution: never packed
        return self.hf.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.patch_embed.proj.weight.device

    def job(self, pixel_values: Tensor, grid_thw: Tensor) -> VisionEncodeJob:
        return VisionEncodeJob(self, pixel_values, grid_thw)

    def encode(self, pixel_values: Tensor, grid_thw: Tensor) -> list[Tensor]:
        """One-shot encode: a job run to completion; one merged embedding tensor per image."""
        job = self.job(pixel_values, grid_thw)
        while not job.done():
            job.advance(float("inf"))
        return job.result()


def _linears(module: nn.Module) -> list[nn.Module]:
    """Linear layers, plain or replaced for the CPU (``engine.layers.linear``)."""
    from engine.layers.linear import CPU_LINEAR_TYPES

    return [m for m in module.modules() if isinstance(m, CPU_LINEAR_TYPES)]


class VisionEncodeJob:
    """Encoding of a set of images that the scheduler advances a bounded amount per step.

    Holds the residual stream of all patches and the current block's q/k/v between calls.
    Costs are in patch-block units (see the module docstring).
    """

    @torch.inference_mode()
    def __init__(self, tower: VisionTower, pixel_values: Tensor, grid_thw: Tensor) -> None:
        self.tower = tower
        grids = [[int(v) for v in row] for row in grid_thw.tolist()]
        device, dtype = tower.device, tower.dtype
        n = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows, grid_thw says {n}")
        self.sizes = [t * h * w // tower.merge_unit for t, h, w in grids]
        self.num_rows = n
        cos, sin = self._rope(position_ids(grids, tower.merge).to(device))
        self.full_segments = frame_segments(grids)
        self.window_segments = self.full_segments
        self.restore: Tensor | None = None
        pixels = pixel_values.to(device)
        if tower.windowed:
            order, self.window_segments = window_order(grids, tower.merge, tower.window)
            order = order.to(device)
            rows = order[:, None] * tower.merge_unit + torch.arange(tower.merge_unit, device=device)
            rows = rows.flatten()
            pixels, cos, sin = pixels[rows], cos[rows], sin[rows]
            self.restore = torch.argsort(order)
        self.pixels, self.cos, self.sin = pixels, cos, sin
        self.x = torch.empty(n, tower.dim, device=device, dtype=dtype)
        shape = (n, tower.num_heads, tower.head_dim)
        self.q, self.k, self.v = (torch.empty(shape, device=device, dtype=dtype) for _ in range(3))
        # the current block's attention output, read by its mlp items
        self.attn_out = torch.empty(n, tower.dim, device=device, dtype=dtype)
        out_dim = _linears(tower.hf.merger)[-1].out_features
        self.merged = torch.empty(n // tower.merge_unit, out_dim, device=device, dtype=dtype)
        self._matmul_attention = (
            dtype == torch.bfloat16 and device.type == "cpu" and not tower.torch_flash
        )
        # the kernels take fp32 too: a bf16 model's tower runs in fp32 where bf16 is emulated
        self._native = (
            device.type == "cpu"
            and tower.kernels is not None
            and not tower.torch_flash
            and dtype in (torch.bfloat16, torch.float32)
        )
        self._kv_heads_block = -1
        self._kv_heads: tuple[Tensor, Tensor] | None = None
        self._packed: dict[tuple[int, int], list[Tensor]] = {}  # (k0, k1) -> packed k/v
        self.items = self._plan()
        self.cursor = 0
        self.items_run = 0
        self._suffix = [0.0] * (len(self.items) + 1)
        for i in range(len(self.items) - 1, -1, -1):
            self._suffix[i] = self._suffix[i + 1] + self.items[i].cost

    # ---- planning ----------------------------------------------------------------------------
    def _rope(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Half-width cos/sin: h frequencies then w frequencies, from the tower's inv_freq."""
        inv_freq = self.tower.hf.rotary_pos_emb.inv_freq.float()
        freqs = (pos[..., None].float() * inv_freq).flatten(1)  # [N, 2 * F]: (h..., w...)
        return freqs.cos(), freqs.sin()

    def _segments(self, block: int) -> list[tuple[int, int]]:
        return self.full_segments if block in self.tower.full_blocks else self.window_segments

    def _ranges(self, n: int, unit: int = 1, scale: int = 1) -> list[tuple[int, int]]:
        """Row spans of ``max_rows_per_item x scale / unit`` rows (one span: whole)."""
        step = self.tower.max_rows_per_item
        step = n if step is None else max(1, step * scale // unit)
        return [(s, min(s + step, n)) for s in range(0, n, step)]

    def _plan(self) -> list[WorkItem]:
        tower, n = self.tower, self.num_rows
        items = [self._item("embed", -1, s, e) for s, e in self._ranges(n)]
        for b in range(tower.depth):
            items += [self._item("qkv", b, s, e) for s, e in self._ranges(n)]
            items += self._attention_items(b)
            items += [self._item("mlp", b, s, e) for s, e in self._ranges(n)]
        merge_rows = n // tower.merge_unit
        items += [
            self._item("merge", -1, s, e) for s, e in self._ranges(merge_rows, tower.merge_unit)
        ]
        return items

    def _attention_items(self, block: int) -> list[WorkItem]:
        """A block's attention, head by head: each item one head over ``max_rows_per_item x
        num_heads`` rows, the cost of an all-heads item of ``max_rows_per_item`` rows.

        Why head-major: beside chat a step has room for a few heads' share of a row-major
        item, so its pieces were a few rows of a head, each streaming that head's keys and
        values (cold after every decode step) for little arithmetic. One head over many rows
        is cut to the room instead. In-process on a 2-core Zen 4 (bf16, 64-row items,
        ``benchmarks.encoder_beside_chat``, in turns): attention beside chat 13.8-14.3 ->
        11.8-12.3 us a unit (10.3 in a whole frame), encoder units per second of step time
        past the decode step 43.7-45.2k -> 57.8-61.1k. Whole (``max_rows_per_item`` None, the
        GPU) stays one call over every head."""
        tower, n = self.tower, self.num_rows
        if tower.max_rows_per_item is None:
            return [self._item("attn", block, 0, n)]
        heads = tower.num_heads
        return [
            self._item("attn", block, s, e, (h, h + 1))
            for h in range(heads)
            for s, e in self._ranges(n, scale=heads)
        ]

    def _item(
        self, kind: str, block: int, s: int, e: int, heads: tuple[int, int] | None = None
    ) -> WorkItem:
        """A work item over rows ``[s, e)`` (attention: of ``heads``, default all) priced in
        patch-block units."""
        tower = self.tower
        unit, d = tower.patch_block_flops, tower.dim
        if kind == "embed":
            return WorkItem(kind, block, s, e, (e - s) * 2 * self.pixels.shape[1] * d / unit)
        qkv = 2 * d * 3 * d / unit
        if kind == "qkv":
            return WorkItem(kind, block, s, e, (e - s) * qkv)
        if kind == "attn":
            h0, h1 = heads or (0, tower.num_heads)
            calls = tuple(attention_calls(self._segments(block), s, e))
            pairs = sum((c.q1 - c.q0) * (c.k1 - c.k0) // c.batch for c in calls)
            # q.k and p.v: 2 matmuls of 2 * head_dim FLOPs per query-key pair per head
            cost = 4 * pairs * tower.head_dim * (h1 - h0) / unit
            return WorkItem(kind, block, s, e, cost, calls, (h0, h1))
        if kind == "mlp":  # the output projection and the MLP: the rest of the unit
            return WorkItem(kind, block, s, e, (e - s) * (1.0 - qkv))
        merger = sum(2 * lin.in_features * lin.out_features for lin in _linears(tower.hf.merger))
        return WorkItem(kind, block, s, e, (e - s) * merger / unit)

    def _split_to_fit(self, max_cost: float) -> None:
        """Cut the next item so that its first part costs at most ``max_cost``: a step with
        little time left, beside chat decodes, still advances the encode by what fits instead
        of a whole item that overruns it.

        Attention is cut by heads first, by rows only within one head. A piece of an image's
        attention reads every key and value of the rows' segment: cut by rows, a few query
        rows stream all heads' keys and values for little arithmetic, while the rows of one
        head reuse a sixth of them many times over. On a 2-core AMX Xeon (640x480 frame, 4,800
        keys, bf16, torch's flash kernel) the same FLOPs took 3.35 ms as 43 rows of all six
        heads and 1.49 ms as 256 rows of one head (4.84 / 2.58 ms on one thread).

        Rows are then cut to the most that fit, at least ``MIN_SPLIT_ROWS``, and neither part
        is left under ``MIN_SPLIT_ROWS`` rows: a piece of a few rows costs about as much as one
        of 16 (beside decodes, one row of a 640x480 frame's attention + MLP took 5 ms, 16 rows
        6 ms), so a cut that would leave such a tail is made earlier."""
        item = self.items[self.cursor]
        h0, h1 = item.heads
        if item.kind == "attn" and h1 - h0 > 1:
            per_head = item.cost / (h1 - h0)
            keep = min(h1 - h0 - 1, max(1, int(max_cost / per_head)))
            cut = h0 + keep
            self._replace_next(
                [
                    self._item(item.kind, item.block, item.start, item.end, (h0, cut)),
                    self._item(item.kind, item.block, item.start, item.end, (cut, h1)),
                ]
            )
            item = self.items[self.cursor]
            if item.cost <= max_cost:
                return
        rows = item.end - item.start
        if rows < 2 * MIN_SPLIT_ROWS:
            return
        heads = item.heads if item.kind == "attn" else None
        if item.kind != "attn" or (len(item.calls) == 1 and item.calls[0].batch == 1):
            # a price linear in the rows (attention within one segment too): no search. The
            # search's dozen re-priced pieces took a quarter of a millisecond a cut, a tenth of
            # the encoder work a step beside chat grants (2-core AMX Xeon, 640x480 frame)
            per_row = item.cost / rows
            fit = int(max_cost / per_row) if per_row > 0 else rows
            if fit * per_row > max_cost:
                fit -= 1
            lo = min(max(fit, MIN_SPLIT_ROWS), rows - MIN_SPLIT_ROWS)
        else:
            # the most rows whose piece fits (windows make the price uneven across rows)
            lo, hi = MIN_SPLIT_ROWS, rows - MIN_SPLIT_ROWS + 1  # lo rows run; hi do not fit
            while hi - lo > 1:
                mid = (lo + hi) // 2
                piece = self._item(item.kind, item.block, item.start, item.start + mid, heads)
                if piece.cost <= max_cost:
                    lo = mid
                else:
                    hi = mid
        cut = item.start + lo
        self._replace_next(
            [
                self._item(item.kind, item.block, item.start, cut, heads),
                self._item(item.kind, item.block, cut, item.end, heads),
            ]
        )

    def _replace_next(self, parts: list[WorkItem]) -> None:
        """The next item replaced by ``parts`` (which cover exactly its work), costs kept."""
        c = self.cursor
        self.items[c : c + 1] = parts
        tail = self._suffix[c + 1]
        suffix = []
        for part in reversed(parts):
            tail += part.cost
            suffix.append(tail)
        self._suffix[c : c + 1] = reversed(suffix)

    # ---- scheduling interface ----------------------------------------------------------------
    @property
    def total_cost(self) -> float:
        return self._suffix[0]

    @property
    def remaining_cost(self) -> float:
        return self._suffix[self.cursor]

    def next_cost(self) -> float:
        """Cost of the next item (0 when done): what ``advance`` must allow to make progress."""
        return 0.0 if self.done() else self.items[self.cursor].cost

    def done(self) -> bool:
        return self.cursor == len(self.items)

    @torch.inference_mode()
    def advance(
        self,
        max_cost: float,
        item_overhead: float = 0.0,
        stop: Callable[[], bool] | None = None,
    ) -> float:
        """Run items while they fit in ``max_cost``; the first always runs, so progress is sure,
        cut down to what fits (``MIN_SPLIT_ROWS`` rows at least) when it alone would not.

        ``item_overhead`` is what running an item costs beyond its FLOPs, in the same units
        (the step-cost model's price of one item over its price of one unit): each item is
        charged it, so a second item runs only when it repays its overhead too, and the first
        is cut to leave room for its own. ``items_run`` counts the items run so far.

        A budget that covers the remaining cost finishes the job whatever the overhead: the
        scheduler lets a prompt chunk reach the image's tokens in the same step on that
        promise.

        ``stop``, when given, is asked before each item: True ends the advance there (an
        interruptible step giving way to a chat request, engine/step_interrupt.py), even
        before the first item.

        Returns the cost spent (items' FLOP costs, without the overhead), which exceeds
        ``max_cost`` only by that minimal first piece.
        """
        if max_cost >= self.remaining_cost * (1 - 1e-9):
            max_cost, item_overhead = math.inf, 0.0
        spent = charged = 0.0
        room = max_cost - item_overhead
        if not self.done() and self.items[self.cursor].cost > room:
            self._split_to_fit(room)
        while not self.done():
            item = self.items[self.cursor]
            if charged > 0 and charged + item.cost + item_overhead > max_cost:
                break
            if stop is not None and stop():
                break
            self._run(item)
            self.cursor += 1
            self.items_run += 1
            spent += item.cost
            charged += item.cost + item_overhead
        if self.done():
            self._release()
        return spent

    def result(self) -> list[Tensor]:
        """Per-image merged embeddings, in the input order of the images."""
        if not self.done():
            raise RuntimeError(f"vision job not done: {self.remaining_cost:.1f} cost left")
        merged = self.merged if self.restore is None else self.merged[self.restore]
        return list(torch.split(merged, self.sizes))

    def _release(self) -> None:
        """Drop the per-patch state once merged: a camera frame's q/k/v is tens of MB."""
        self.x = self.q = self.k = self.v = self.attn_out = None
        self.pixels = self.cos = self.sin = None
        self._kv_heads = None

    # ---- the math ----------------------------------------------------------------------------
    def _run(self, item: WorkItem) -> None:
        s, e = item.start, item.end
        if item.kind == "embed":
            weight = self.tower.hf.patch_embed.proj.weight
            self.x[s:e] = F.linear(self.pixels[s:e].to(weight.dtype), weight.flatten(1))
        elif item.kind == "qkv":
            self._qkv(self.tower.hf.blocks[item.block], s, e)
        elif item.kind == "attn":
            h0, h1 = item.heads
            cols = slice(h0 * self.tower.head_dim, h1 * self.tower.head_dim)
            parts = [self._attend(item.block, c, h0, h1) for c in item.calls]
            self.attn_out[s:e, cols] = parts[0] if len(parts) == 1 else torch.cat(parts)
        elif item.kind == "mlp":
            self._mlp_rows(self.tower.hf.blocks[item.block], s, e)
        else:
            self._merge(s, e)

    def _qkv(self, block: nn.Module, s: int, e: int) -> None:
        h = rms_or_layer_norm(block.norm1, self.x[s:e])
        qkv = block.attn.qkv(h).view(e - s, 3, self.tower.num_heads, self.tower.head_dim)
        self.q[s:e] = apply_rope(qkv[:, 0], self.cos[s:e], self.sin[s:e])
        self.k[s:e] = apply_rope(qkv[:, 1], self.cos[s:e], self.sin[s:e])
        self.v[s:e] = qkv[:, 2]

    def _mlp_rows(self, block: nn.Module, s: int, e: int) -> None:
        h = self.x[s:e] + block.attn.proj(self.attn_out[s:e])
        self.x[s:e] = h + self._mlp(block.mlp, rms_or_layer_norm(block.norm2, h))

    def _attend(self, index: int, call: AttentionCall, h0: int, h1: int) -> Tensor:
        """Attention of heads ``[h0, h1)`` for one call; returns ``[q rows, heads * hd]``."""
        if self._native:
            return self._attend_native(index, call, h0, h1)
        if call.batch == 1 and self._matmul_attention:
            return self._attend_by_matmuls(index, call, h0, h1)
        heads, hd, b = h1 - h0, self.tower.head_dim, call.batch
        q = self.q[call.q0 : call.q1, h0:h1].view(b, -1, heads, hd).transpose(1, 2)
        k = self.k[call.k0 : call.k1, h0:h1].view(b, -1, heads, hd).transpose(1, 2)
        v = self.v[call.k0 : call.k1, h0:h1].view(b, -1, heads, hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(call.q1 - call.q0, heads * hd)

    def _attend_by_matmuls(self, index: int, call: AttentionCall, h0: int, h1: int) -> Tensor:
        """bf16 on CPU: scores and probabilities through two batched matmuls per 64 query rows.

        Why: without AMX, PyTorch's CPU flash kernel computes bf16 attention at the fp32 rate
        (measured ~150 GFLOP/s here, against ~420 for a bf16 matmul); two ``bmm`` calls over
        a head-major copy of the block's keys/values run at ~200 GFLOP/s on the 64-row items
        the scheduler grants (vs ~125 for the flash kernel on the same rows), which takes a
        third off a 640x480 frame's encode. The scores are bf16 before the (fp32-accumulated)
        softmax, as in ``transformers``' eager attention; fp32 keeps the fused kernel.
        """
        keys_t, values = self._heads_first_kv(index)
        heads, hd = h1 - h0, self.tower.head_dim
        k_t, v = keys_t[h0:h1, :, call.k0 : call.k1], values[h0:h1, call.k0 : call.k1]
        scale = hd**-0.5
        out = torch.empty(call.q1 - call.q0, heads, hd, dtype=self.q.dtype, device=self.q.device)
        for r in range(call.q0, call.q1, _SCORE_ROWS):
            e = min(r + _SCORE_ROWS, call.q1)
            q = (self.q[r:e, h0:h1] * scale).transpose(0, 1).contiguous()  # [heads, rows, hd]
            probs = torch.softmax(torch.bmm(q, k_t), dim=-1)
            out[r - call.q0 : e - call.q0] = torch.bmm(probs, v).transpose(0, 1)
        return out.view(call.q1 - call.q0, heads * hd)

    def _attend_native(self, index: int, call: AttentionCall, h0: int, h1: int) -> Tensor:
        """CPU with engine.kernels: its flash kernel per segment (image or window), for a bf16
        tower or the fp32 tower of a bf16 model where bf16 is emulated.

        Keys/values are packed for the kernel once per segment per block, all heads (the
        packed tensors are head-major, so a head range is a slice of them), since a block's
        queries arrive in many work items: a third faster than the two-bmm path, whose score
        matrix makes a round trip through memory."""
        kernels, scale = self.tower.kernels, self.tower.head_dim**-0.5
        if self._kv_heads_block != index:
            self._packed.clear()
            self._kv_heads_block = index
        q_len, k_len = (call.q1 - call.q0) // call.batch, (call.k1 - call.k0) // call.batch
        parts = []
        for b in range(call.batch):
            k0 = call.k0 + b * k_len
            packed = self._packed.get((k0, k0 + k_len))
            if packed is None:
                packed = kernels.pack_kv(self.k[k0 : k0 + k_len], self.v[k0 : k0 + k_len])
                self._packed[(k0, k0 + k_len)] = packed
            q0 = call.q0 + b * q_len
            heads = [packed[0][h0:h1], packed[1][h0:h1], packed[2]]
            q = self.q[q0 : q0 + q_len, h0:h1]
            parts.append(kernels.attend_packed(q, heads, scale, False, self.tower.amx_attention))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.view(call.q1 - call.q0, -1)

    def _heads_first_kv(self, index: int) -> tuple[Tensor, Tensor]:
        """This block's keys as ``[heads, hd, rows]`` and values as ``[heads, rows, hd]``,
        copied once per block (all its qkv items run before any of its attention items)."""
        if self._kv_heads_block != index:
            self._kv_heads = (
                self.k.permute(1, 2, 0).contiguous(),
                self.v.transpose(0, 1).contiguous(),
            )
            self._kv_heads_block = index
        return self._kv_heads

    def _mlp(self, mlp: nn.Module, x: Tensor) -> Tensor:
        if hasattr(mlp, "gate_proj"):  # Qwen2.5-VL: SwiGLU
            return mlp.down_proj(self.tower.act(mlp.gate_proj(x)) * mlp.up_proj(x))
        return mlp.fc2(self.tower.act(mlp.fc1(x)))

    def _merge(self, s: int, e: int) -> None:
        merger, unit = self.tower.hf.merger, self.tower.merge_unit
        h = rms_or_layer_norm(merger.ln_q, self.x[s * unit : e * unit]).view(e - s, -1)
        first, act, second = merger.mlp
        self.merged[s:e] = second(F.gelu(first(h), approximate=act.approximate))
