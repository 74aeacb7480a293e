"""KV-cache block accounting: which physical blocks each request owns, and prefix caching.

Mechanism only: the scheduler decides who gets blocks and whom to preempt; this module hands
out fixed-size blocks, keeps per-request block tables and reference counts, and takes
everything back at once when a request finishes, is aborted or is preempted.

Prefix caching: every *full* block is named by a hash chain over the token ids it holds, the
content hash of any image whose placeholders it covers, and its parent block's hash — so the
same system prompt, or the same frame asked about twice, maps to the same blocks. A freed block
keeps its contents and its name until the free list hands it out again (least recently freed
first), so a later request with the same prefix reuses it without recomputing.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: tuple = ()) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(repr((tuple(token_ids), extra)).encode())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # free blocks, eviction order first; O(1) removal when a cached one is reused
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: dict[int, BlockHash] = {}
        self.cached: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            old = self.block_hash.pop(b, None)  # evict whatever prefix it still held
            if old is not None and self.cached.get(old) == b:
                del self.cached[old]
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def share(self, block: int) -> None:
        """Add a user to a cached block (taking it off the free list if nobody held it)."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        # tail blocks first: they are the least likely to be shared, so evict them first
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None

    def name(self, block: int, block_hash: BlockHash) -> None:
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self.num_named: dict[str, int] = {}  # leading blocks of a request already hashed
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

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
        table = self.block_tables.setdefault(request_id, [])
        if need:
            table.extend(self.pool.take(need))
        return True

    # ---- prefix caching -------------------------------------------------------------------
    def find_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Blocks holding the longest cached prefix of these full-block hashes."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in block_hashes:
            b = self.pool.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_with_prefix(
        self, request_id: str, cached_blocks: list[int], total_tokens: int, query_tokens: int
    ) -> bool:
        """Admit a request reusing ``cached_blocks`` for its first tokens, plus fresh blocks up
        to ``total_tokens``. All or nothing."""
        fresh = max(0, -(-total_tokens // self.block_size) - len(cached_blocks))
        reusable_free = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if fresh > self.pool.num_free - reusable_free:
            return False
        for b in cached_blocks:
            self.pool.share(b)
        self.block_tables[request_id] = [*cached_blocks, *self.pool.take(fresh)]
        self.num_named[request_id] = len(cached_blocks)
        self.prefix_queries += query_tokens
        self.prefix_hits += len(cached_blocks) * self.block_size
        return True

    def name_full_blocks(self, request_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """Register the hashes of the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request_id)
        if table is None:
            return
        start = self.num_named.get(request_id, 0)
        for i in range(start, min(len(block_hashes), len(table))):
            self.pool.name(table[i], block_hashes[i])
        self.num_named[request_id] = max(start, min(len(block_hashes), len(table)))

    def free(self, request_id: str) -> None:
        self.num_named.pop(request_id, None)
        blocks = self.block_tables.pop(request_id, None)
        if blocks:
            self.pool.release(blocks)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]
