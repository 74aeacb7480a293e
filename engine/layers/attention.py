"""Paged attention over a flat mixed batch, in portable torch (CPU and GPU).

The KV cache of one layer is a flat array of slots
``[num_blocks * block_size, kv_heads, head_dim]``;
a request's block table maps its token index ``i`` to slot
``block_table[i // block_size] * block_size + i % block_size``. New keys/values are written
to their slots first, then each query attends to the slots of its own request's context.

Decode rows (one query each) are attended in one padded batched call; each prefill chunk is one
call attending causally to the cached keys of earlier chunks plus itself. A chunk that starts at
position 0 attends to its freshly computed keys directly (no gather) with a causal kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunkMeta:
    q_start: int  # row range of this chunk in the flat batch
    q_end: int
    context_slots: torch.Tensor | None  # [context_len] slots to read; None: chunk starts at 0
    mask: torch.Tensor | None  # [q_len, context_len] bool, True = attend; None with the above
    # native kernels, a short late chunk: each query row runs as a decode row of the paged
    # kernel (block table [1, blocks], context lengths start+1 .. start+n), no k/v repacking
    block_table: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    _grouped: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def grouped_mask(self, group: int) -> torch.Tensor:
        """The mask tiled for ``group`` query heads per KV head; built once per step."""
        if group not in self._grouped:
            self._grouped[group] = self.mask.repeat(group, 1)
        return self._grouped[group]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token (decodes first, then prefill chunks)
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None  # [B, Lmax] padded context slots of each decode
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] bool
    # for engine.kernels' paged decode attention instead of the two above
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_lens: torch.Tensor | None = None  # [B] context length incl. the new token
    block_size: int = 0
    prefills: list[PrefillChunkMeta] = field(default_factory=list)


def padded_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one [rows, longest] tensor, zero-padded (the kernels read only the
    blocks a row's context length covers)."""
    width = max(len(t) for t in tables)
    # one tensor from padded lists: a copy per row cost ~10 us each (0.2 ms at batch 16)
    return torch.tensor([[*t, *[0] * (width - len(t))] for t in tables], dtype=torch.long)


# a late prefill chunk this short (a few tokens riding along with decodes under an ITL
# target) attends through the paged decode kernel, row by row: repacking its whole cached
# prefix for the flash kernel would cost more than the attention itself
SHORT_CHUNK_ROWS = 32


def build_attention_metadata(
    block_tables: list[list[int]],
    starts: list[int],
    lengths: list[int],
    block_size: int,
    device: torch.device,
    native_decode: bool = False,
) -> AttentionMetadata:
    """Per-step metadata shared by all layers.

    Entry ``i`` describes one scheduled request: its block table, the index of its first new
    token (``start`` = tokens already in the cache) and how many new tokens it brings. Entries
    with ``length == 1`` and ``start > 0`` must come first (decodes). ``native_decode``: the
    decodes will run engine.kernels' paged attention, which reads block tables directly.
    """
    slot_parts: list[torch.Tensor] = []
    context_slots: list[torch.Tensor] = []
    for table, start, length in zip(block_tables, starts, lengths, strict=True):
        ctx = start + length
        idx = torch.arange(ctx)
        table_t = torch.tensor(table, dtype=torch.long)
        slots = table_t[idx // block_size] * block_size + idx % block_size
        context_slots.append(slots)
        slot_parts.append(slots[start:])

    num_decodes = 0
    while num_decodes < len(lengths) and lengths[num_decodes] == 1 and starts[num_decodes] > 0:
        num_decodes += 1

    meta = AttentionMetadata(
        slot_mapping=torch.cat(slot_parts).to(device) if slot_parts else torch.empty(0),
        num_decodes=num_decodes,
    )
    meta.block_size = block_size
    if num_decodes and native_decode:
        meta.decode_block_tables = padded_block_tables(block_tables[:num_decodes])
        meta.decode_lens = torch.tensor([s + 1 for s in starts[:num_decodes]], dtype=torch.long)
    elif num_decodes:
        max_len = max(len(s) for s in context_slots[:num_decodes])
        padded = torch.zeros(num_decodes, max_len, dtype=torch.long)
        mask = torch.zeros(num_decodes, max_len, dtype=torch.bool)
        for row, slots in enumerate(context_slots[:num_decodes]):
            padded[row, : len(slots)] = slots
            mask[row, : len(slots)] = True
        meta.decode_slots = padded.to(device)
        meta.decode_mask = mask.view(num_decodes, 1, 1, max_len).to(device)

    row = num_decodes
    for i in range(num_decodes, len(lengths)):
        start, length = starts[i], lengths[i]
        if start == 0:
            meta.prefills.append(PrefillChunkMeta(row, row + length, None, None))
        elif native_decode and length <= SHORT_CHUNK_ROWS:
            meta.prefills.append(
                PrefillChunkMeta(
                    row,
                    row + length,
                    context_slots[i].to(device),
                    None,
                    block_table=torch.tensor([block_tables[i]], dtype=torch.long),
                    context_lens=torch.arange(start + 1, start + length + 1),
                )
            )
        else:
            q_pos = torch.arange(start, start + length).unsqueeze(1)
            k_pos = torch.arange(start + length).unsqueeze(0)
            meta.prefills.append(
                PrefillChunkMeta(
                    row, row + length, context_slots[i].to(device), (k_pos <= q_pos).to(device)
                )
            )
        row += length
    return meta


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels=None,
    native_prefill: bool = True,
    amx: bool = False,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [slots, KVH, D]. Returns [T, H, D].

    ``kernels`` (engine.kernels, bf16 CPU only): decodes and short late chunks run its paged
    kernel, and, with ``native_prefill`` (the platform plan's choice), longer prompt chunks
    its flash kernel, which takes grouped KV heads and a causal offset directly; without it
    they run torch's flash kernel, which on AMX CPUs computes in tiles at several times the
    rate of ours without ``amx`` (its products on AMX tiles: the platform plan's choice
    there)."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)

    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    # GQA by grouping query heads under their shared KV head (head h uses KV head h // group):
    # no K/V copies, and it avoids SDPA's enable_gqa + mask path, ~6x slower in bf16 on CPU.
    nd = meta.num_decodes
    if nd and meta.decode_block_tables is not None:
        out[:nd] = kernels.decode_attention(
            q[:nd],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_lens,
            meta.block_size,
            scale,
        )
    elif nd:
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)  # [B, KVH, group, D]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, num_heads, head_dim)

    paged = kernels is not None and q.dtype == torch.bfloat16 and q.device.type == "cpu"
    native = paged and native_prefill
    for chunk in meta.prefills:
        n = chunk.q_end - chunk.q_start
        if paged and chunk.block_table is not None:
            out[chunk.q_start : chunk.q_end] = kernels.decode_attention(
                q[chunk.q_start : chunk.q_end],
                k_cache,
                v_cache,
                chunk.block_table.expand(n, -1),
                chunk.context_lens,
                meta.block_size,
                scale,
            )
            continue
        if native:  # keys: the cached prefix (if any), then the chunk's own
            rows = slice(chunk.q_start, chunk.q_end)
            kc, vc = k[rows], v[rows]
            if chunk.context_slots is not None:
                prefix = chunk.context_slots[: chunk.context_slots.shape[0] - n]
                kc = torch.cat([k_cache[prefix], kc])
                vc = torch.cat([v_cache[prefix], vc])
            out[rows] = kernels.flash_attention(q[rows], kc, vc, scale, True, amx)
            continue
        if chunk.context_slots is None:
            qp = q[chunk.q_start : chunk.q_end].transpose(0, 1)  # [H, n, D]
            kp = k[chunk.q_start : chunk.q_end].transpose(0, 1)
            vp = v[chunk.q_start : chunk.q_end].transpose(0, 1)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1
            )
            out[chunk.q_start : chunk.q_end] = op.transpose(0, 1)
            continue
        if _FLASH_CPU is not None and q.device.type == "cpu":
            out[chunk.q_start : chunk.q_end] = _prefix_plus_causal(
                q, k, v, k_cache, v_cache, chunk, group, scale
            )
            continue
        # rows (g, i) of the grouped query attend like query i: the mask repeats per group
        qp = q[chunk.q_start : chunk.q_end].view(n, num_kv_heads, group, head_dim)
        qp = qp.permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
        kp = k_cache[chunk.context_slots].transpose(0, 1)  # [KVH, L, D]
        vp = v_cache[chunk.context_slots].transpose(0, 1)
        mask = chunk.grouped_mask(group)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
        op = op.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
        out[chunk.q_start : chunk.q_end] = op.reshape(n, num_heads, head_dim)
    return out


# The CPU flash kernel also returns each row's log-sum-exp, which lets a chunk's attention be
# computed as two exact pieces — all cached keys (no mask) and its own keys (causal, so the
# kernel skips the masked half) — merged by their log-sum-exps. A single call with an explicit
# mask would compute every masked score too: up to 2x the work when a chunk is long.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefix_plus_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunkMeta,
    group: int,
    scale: float,
) -> torch.Tensor:
    rows = slice(chunk.q_start, chunk.q_end)
    n = chunk.q_end - chunk.q_start
    start = chunk.context_slots.shape[0] - n
    prefix = chunk.context_slots[:start]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]

    # cached prefix, no mask: the `group` query heads sharing a KV head are stacked as one
    # longer query sequence, so the prefix keys are read as they are in the cache (a late
    # chunk of a long prompt would otherwise copy its whole prefix `group` times per layer)
    qg = q[rows].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(1, num_kv_heads, group * n, head_dim)
    kp = k_cache[prefix].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
    vp = v_cache[prefix].transpose(0, 1).unsqueeze(0)
    o_old, lse_old = _FLASH_CPU(qg, kp, vp, 0.0, False, scale=scale)
    o_old = o_old.reshape(1, num_kv_heads * group, n, head_dim)
    lse_old = lse_old.reshape(1, -1, n)  # [1, H, n]: head h = kv head h // group, as q

    # the chunk's own keys, causal: short, so repeating them per query head is cheap
    def heads_first(t: torch.Tensor) -> torch.Tensor:  # [n, KVH, D] -> [1, H, n, D]
        if group > 1:
            t = t.repeat_interleave(group, dim=1)
        return t.transpose(0, 1).unsqueeze(0)

    qh = q[rows].transpose(0, 1).unsqueeze(0)
    o_new, lse_new = _FLASH_CPU(
        qh, heads_first(k[rows]), heads_first(v[rows]), 0.0, True, scale=scale
    )
    lse = torch.logaddexp(lse_old, lse_new)
    merged = o_old.float() * torch.exp(lse_old - lse).unsqueeze(-1)
    merged += o_new.float() * torch.exp(lse_new - lse).unsqueeze(-1)
    return merged.to(q.dtype)[0].transpose(0, 1)
