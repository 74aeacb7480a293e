"""Encoder-cache accounting: which image embeddings are held, by content hash.

The scheduler asks this manager whether an image needs encoding; the model runner holds the
tensors (and the half-done encoding jobs) and is told through the scheduler output what to
compute and what to drop. An entry is *encoding* until the runner reports its job done; the
scheduler hands an encoding job a bounded amount of work per step (stall-free encoding).
Entries referenced by live requests are pinned; unreferenced entries stay for reuse (the same
frame asked again) until space is needed, oldest first.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.sizes: dict[str, int] = {}
        self.refs: dict[str, set[str]] = {}  # hash -> request ids using it
        self.unreferenced: OrderedDict[str, None] = OrderedDict()  # LRU order
        self.used = 0
        self.hits = 0
        self.misses = 0
        # hash -> work left (patch-block units) while encoding; None: started, size unknown yet
        self.remaining: dict[str, float | None] = {}
        # half-done encodings no request waits for any more: the runner drops their jobs
        self._abandoned: list[str] = []

    def contains(self, content_hash: str) -> bool:
        return content_hash in self.sizes

    def ready(self, content_hash: str) -> bool:
        """Embeddings exist (not merely an encoding in progress)."""
        return content_hash in self.sizes and content_hash not in self.remaining

    def encoding_left(self, content_hash: str) -> float | None:
        return self.remaining.get(content_hash)

    def update_progress(self, progress: dict[str, float]) -> None:
        """The runner's report: work left per job; 0 means the embeddings are ready."""
        for h, left in progress.items():
            if h not in self.sizes:
                continue  # evicted meanwhile
            if left <= 0:
                self.remaining.pop(h, None)
            else:
                self.remaining[h] = left

    def acquire(
        self, content_hash: str, request_id: str, num_tokens: int
    ) -> tuple[bool, list[str]]:
        """Pin ``content_hash`` for a request. Returns (must_encode, hashes evicted to make room).

        Never refuses: when pinned entries exceed capacity the cache runs over rather than
        deadlocking the request (the excess is released when requests finish).
        """
        evicted: list[str] = []
        if content_hash in self.sizes:
            users = self.refs.setdefault(content_hash, set())
            if request_id not in users:
                self.hits += 1
            users.add(request_id)
            self.unreferenced.pop(content_hash, None)
            return False, evicted
        self.misses += 1
        while self.used + num_tokens > self.capacity and self.unreferenced:
            old, _ = self.unreferenced.popitem(last=False)
            self.used -= self.sizes.pop(old)
            self.refs.pop(old, None)
            self.remaining.pop(old, None)
            evicted.append(old)
        self.sizes[content_hash] = num_tokens
        self.refs[content_hash] = {request_id}
        self.remaining[content_hash] = None
        self.used += num_tokens
        return True, evicted

    def release_request(
        self, request_id: str, hashes: list[str], keep_encoding: bool = False
    ) -> None:
        """Unpin a request's images. An encoding still in progress that no other request
        waits for is dropped (see :meth:`take_abandoned`) unless ``keep_encoding`` (a preempted
        request comes back for it): a half-done job holds the tower's per-patch state, tens of
        times its finished embeddings (a 640x480 frame through a 1,280-wide tower: ~150-200 MB
        against ~4 MB), and camera frames that expire or are aborted mid-encoding would
        otherwise keep theirs until the cache's token count pushed them out."""
        for h in hashes:
            users = self.refs.get(h)
            if users is None:
                continue
            users.discard(request_id)
            if users:
                continue
            if h in self.remaining and not keep_encoding:
                self.used -= self.sizes.pop(h)
                self.refs.pop(h)
                self.remaining.pop(h)
                self._abandoned.append(h)
            else:
                self.unreferenced[h] = None

    def take_abandoned(self) -> list[str]:
        """Encodings dropped since the last call, for the runner to free."""
        abandoned, self._abandoned = self._abandoned, []
        return abandoned

    def pinned_by(self, content_hash: str, request_id: str) -> bool:
        return request_id in self.refs.get(content_hash, ())
