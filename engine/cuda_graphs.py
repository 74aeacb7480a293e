"""Decode-only steps on a GPU as replayed CUDA graphs.

Why: a decode step of a small model is a few hundred tiny kernels, and launching them costs more
than running them: the GPU waits on Python and the launch queue. A graph captured once per shape
replays the whole step in one launch. On an H200 (``python -m benchmarks.decode_graphs``) the
bench checkpoint's decode step at batch 1 took 1.6 ms replayed against 7.3 eager, a
Qwen2-VL-2B-shaped one's 6.0 against 16.7 (1,200 tokens of context), batch 64 7.8 against 12.6
and 14.3 against 23.0.

A graph replays fixed shapes and fixed addresses, so a step is padded into a bucket: its batch
to the next capture size (1, 2, 4, 8, then multiples of 8, as vLLM captures) and its longest
context to the next power of two of KV blocks. Inputs go through static device buffers the graph
was captured on; padding rows write their keys and values to a scratch slot past the cache's
last block (the runner allocates it) and attend to one masked-in key, so they touch no
request's state. Graphs are captured on first use of a bucket and share one memory pool; every
graph writes its logits into one buffer, valid until the next replay (the runner's sampling has
finished with them by then), so the graphs' outputs do not pile up one per bucket.

The padded forward is plain torch: with ``capture=False`` it runs eagerly, which is how CPU
tests check the padding, the scratch slot and the bucketing give the tokens of the eager path.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.layers.attention import AttentionMetadata
from engine.scheduler import ScheduledChunk

log = logging.getLogger("engine.runner")

# the smallest context bucket, in KV blocks: shorter contexts share one graph (at block size
# 16, 256 keys: padded attention over that many costs nothing next to the step's launches)
MIN_CONTEXT_BLOCKS = 16
# a bucket whose gathered keys and values would pass this stays eager: the graph's padded
# attention gathers every context slot of every row, one layer's at a time
MAX_GATHER_BYTES = 1 << 30
# columns of the per-row staging buffer before the block table
_ID, _POS, _SLOT, _LEN, _TABLE = 0, 1, 4, 5, 6


def batch_buckets(max_batch: int) -> list[int]:
    """Capture sizes up to ``max_batch``: 1, 2, 4, 8, 16, 24, ... and ``max_batch`` itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def context_bucket(blocks: int, max_blocks: int) -> int:
    """The KV blocks a graph spans for a context of ``blocks``: the next power of two from
    :data:`MIN_CONTEXT_BLOCKS`, capped at the longest context the engine allows."""
    bucket = MIN_CONTEXT_BLOCKS
    while bucket < blocks:
        bucket *= 2
    return min(bucket, max_blocks)


class DecodeGraphs:
    """Padded decode steps over the runner's model and KV cache, replayed as CUDA graphs."""

    def __init__(
        self,
        model,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_batch: int,
        max_model_len: int,
        scratch_slot: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.batch_sizes = batch_buckets(max_batch)
        self.scratch_slot = scratch_slot
        self.device = device
        self.capture = capture
        k_cache = kv_caches[0][0]
        # bytes one context slot of one row gathers in a layer (its key and value)
        self._slot_bytes = 2 * k_cache[0].numel() * k_cache.element_size()
        rows, width = self.batch_sizes[-1], _TABLE + self.max_blocks
        # a padding row's values: rows past a step's own hold them in the staging buffer
        padding = torch.zeros(rows, width, dtype=torch.long)
        padding[:, _SLOT] = scratch_slot
        padding[:, _LEN] = 1
        self._padding_np = padding.numpy()
        self._staging = padding.clone()
        self._staging_np = self._staging.numpy()  # the same memory, written row by row
        self._static = padding.to(device)  # what the graphs read
        self._key_index = torch.arange(self.max_blocks * block_size, device=device)
        self._slot_offsets = torch.arange(block_size, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        vocab = model.text_config.vocab_size
        self._logits = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self._pool = None
        self._dirty_rows = 0  # staging rows written by earlier steps
        self.steps = 0  # steps run through here (replayed, or eager without capture)

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(batch, KV blocks) of every graph captured so far."""
        return list(self._graphs)

    def bucket(self, chunks: list[ScheduledChunk]) -> tuple[int, int] | None:
        """(batch, KV blocks) of the graph a decode-only step pads into; None for any other
        step (prompt rows, a row that does not sample, past the largest bucket)."""
        if not chunks or len(chunks) > self.batch_sizes[-1]:
            return None
        if not all(c.is_decode and c.num_tokens == 1 and c.sample for c in chunks):
            return None
        blocks = max(-(-(c.start + 1) // self.block_size) for c in chunks)
        if blocks > self.max_blocks:
            return None
        batch = self._batch_bucket(len(chunks))
        blocks = context_bucket(blocks, self.max_blocks)
        if batch * blocks * self.block_size * self._slot_bytes > MAX_GATHER_BYTES:
            return None
        return batch, blocks

    def logits(self, chunks: list[ScheduledChunk], bucket: tuple[int, int]) -> torch.Tensor:
        """[len(chunks), vocab] float logits of the step padded into ``bucket`` (from
        :meth:`bucket`); valid until the next call."""
        n = len(chunks)
        batch, blocks = bucket
        self._stage(chunks)
        self.steps += 1
        # all the graph reads: its rows (padding past this step's) and its table columns
        self._static[:batch, : _TABLE + blocks].copy_(self._staging[:batch, : _TABLE + blocks])
        if not self.capture:
            return self._forward(batch, blocks)[:n]
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._graphs[bucket] = self._capture(batch, blocks)
        graph.replay()
        return self._logits[:n]

    def _batch_bucket(self, n: int) -> int:
        return next(b for b in self.batch_sizes if b >= n)

    def _stage(self, chunks: list[ScheduledChunk]) -> None:
        """This step's rows into the host staging buffer, through its numpy view: a torch
        write per row cost ~15 us (a millisecond a step at batch 64, a quarter of a bench step
        on an H200), a numpy one a few. Rows the last step used and this one does not go back
        to padding. Table columns past a row's own blocks keep whatever an earlier step left
        there: real block ids, which the row's context length masks out."""
        n = len(chunks)
        staging = self._staging_np
        if self._dirty_rows > n:
            staging[n : self._dirty_rows, :_TABLE] = self._padding_np[n : self._dirty_rows, :_TABLE]
        self._dirty_rows = n
        bs = self.block_size
        for row, c in enumerate(chunks):
            pos = c.start  # the new token's index in its sequence
            if c.text_position is not None:
                p0 = p1 = p2 = c.text_position
            else:
                p0, p1, p2 = (int(v) for v in c.position_ids().reshape(3, -1)[:, -1])
            slot = c.block_table[pos // bs] * bs + pos % bs
            staging[row, :_TABLE] = (c.token_ids[0], p0, p1, p2, slot, pos + 1)
            blocks = pos // bs + 1
            staging[row, _TABLE : _TABLE + blocks] = c.block_table[:blocks]

    def _forward(self, batch: int, blocks: int) -> torch.Tensor:
        """The padded step from the static buffers: what a graph captures."""
        rows = self._static[:batch]
        span = blocks * self.block_size
        tables = rows[:, _TABLE : _TABLE + blocks]
        slots = (tables[:, :, None] * self.block_size + self._slot_offsets).reshape(batch, span)
        mask = self._key_index[:span] < rows[:, _LEN, None]
        meta = AttentionMetadata(
            slot_mapping=rows[:, _SLOT].contiguous(),
            num_decodes=batch,
            decode_slots=slots,
            decode_mask=mask.view(batch, 1, 1, span),
            block_size=self.block_size,
        )
        hidden = self.model.embed(rows[:, _ID].contiguous())
        positions = rows[:, _POS:_SLOT].t().contiguous()
        hidden = self.model(hidden, positions, self.kv_caches, meta)
        return self._logits[:batch].copy_(self.model.logits(hidden))

    def _capture(self, batch: int, blocks: int) -> torch.cuda.CUDAGraph:
        """Warm the bucket's kernels up on a side stream (first calls allocate and pick
        algorithms, which a capture must not), then record one step. The warm-up writes the
        same keys and values the replay will."""
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(batch, blocks)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(batch, blocks)
        self._pool = graph.pool()
        log.info(
            "captured a decode graph: batch %d, %d keys (%.0f ms)",
            batch,
            blocks * self.block_size,
            1e3 * (time.perf_counter() - t0),
        )
        return graph
