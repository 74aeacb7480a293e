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


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token (decodes first, then prefill chunks)
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None  # [B, Lmax] padded context slots of each decode
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] bool
    prefills: list[PrefillChunkMeta] = field(default_factory=list)


def build_attention_metadata(
    block_tables: list[list[int]],
    starts: list[int],
    lengths: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Per-step metadata shared by all layers.

    Entry ``i`` describes one scheduled request: its block table, the index of its first new
    token (``start`` = tokens already in the cache) and how many new tokens it brings. Entries
    with ``length == 1`` and ``start > 0`` must come first (decodes).
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
    if num_decodes:
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
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [slots, KVH, D]. Returns [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)

    nd = meta.num_decodes
    if nd:
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out[:nd] = od.squeeze(2)

    for chunk in meta.prefills:
        qp = q[chunk.q_start : chunk.q_end].transpose(0, 1)  # [H, n, D]
        if chunk.context_slots is None:
            kp = k[chunk.q_start : chunk.q_end].transpose(0, 1)
            vp = v[chunk.q_start : chunk.q_end].transpose(0, 1)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            kp = k_cache[chunk.context_slots].transpose(0, 1)  # [KVH, L, D]
            vp = v_cache[chunk.context_slots].transpose(0, 1)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=chunk.mask, scale=scale, enable_gqa=True
            )
        out[chunk.q_start : chunk.q_end] = op.transpose(0, 1)
    return out
