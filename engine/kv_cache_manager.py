"""KV-cache block accounting: which physical blocks each request owns.

Mechanism only: the scheduler decides who gets blocks and whom to preempt; this module hands
out fixed-size blocks from a free list, keeps per-request block tables and reference counts,
and takes everything back at once when a request finishes, is aborted or is preempted.
(Ref counts exist so prefix caching can share blocks between requests.)
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def take(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_blocks)} free")
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, request_id: str, total_tokens: int) -> int:
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-total_tokens // self.block_size) - have)

    def allocate(self, request_id: str, total_tokens: int) -> bool:
        """Grow the request's table to hold ``total_tokens``; False (and no change) if short."""
        need = self.blocks_needed(request_id, total_tokens)
        if need > self.pool.num_free:
            return False
        if need:
            self.block_tables.setdefault(request_id, []).extend(self.pool.take(need))
        else:
            self.block_tables.setdefault(request_id, [])
        return True

    def free(self, request_id: str) -> None:
        blocks = self.block_tables.pop(request_id, None)
        if blocks:
            self.pool.release(blocks)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]
