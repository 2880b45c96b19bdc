"""Physical KV blocks of the paged cache: reference counts, free blocks, and the prefix cache's hash chain.

A block is in exactly one of three places:
  free   - reference count 0, no hash: handed out first (the one after a sequence's last block when it is free, so
           a lone sequence's blocks are physically consecutive and attention reads them as one view);
  cached - reference count 0 with a hash: its K/V still holds a full prompt block, kept for a later prefix hit,
           evicted least recently freed first when no free block is left;
  used   - reference count >= 1: in the block tables of that many sequences.
A hash names a full block of prompt tokens by its whole prefix: hash(parent block's hash, the block's token ids).
Hashed blocks are never written again (the paged cache asserts it), so sharing one needs no copy.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Sequence

ROOT = 0  # the parent hash of a sequence's first block


class BlocksExhausted(RuntimeError):
    """No free or cached block is left."""


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash chain's next link: names a block by its tokens and (through `parent`) every token before it."""
    return hash((parent, tuple(tokens)))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self._free = set(range(num_blocks))
        self._heap = list(range(num_blocks))  # lowest free block first; stale entries skipped on pop
        self.cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.hash_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (hash, its tokens)
        self.by_hash: dict[int, int] = {}  # hash -> block
        self.peak_used = 0  # the most blocks in block tables at once (what the requests needed at their peak)

    @property
    def num_free(self) -> int:
        """Blocks a sequence can get now: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def take(self, after: int | None = None) -> int:
        """A block for new positions (reference count 1): `after + 1` when free, else the lowest free block, else
        the least recently freed cached one (its hash forgotten)."""
        if after is not None and after + 1 in self._free:
            b = after + 1
        else:
            while self._heap and self._heap[0] not in self._free:
                heapq.heappop(self._heap)
            if self._heap:
                b = heapq.heappop(self._heap)
            elif self.cached:
                b, _ = self.cached.popitem(last=False)
                h, _ = self.hash_of.pop(b)
                del self.by_hash[h]
                self._free.add(b)
            else:
                raise BlocksExhausted(f"all {self.num_blocks} KV blocks are in use")
        self._free.discard(b)
        assert self.ref[b] == 0 and b not in self.hash_of
        self.ref[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return b

    def lookup(self, h: int, tokens: Sequence[int]) -> int | None:
        """The block holding these prompt tokens under this prefix, if one is cached or in use."""
        b = self.by_hash.get(h)
        if b is None or self.hash_of[b][1] != tuple(tokens):
            return None
        return b

    def acquire(self, b: int) -> None:
        """One more sequence reads hashed block b."""
        assert b in self.hash_of, f"block {b} has no hash: only full prompt blocks are shared"
        if self.ref[b] == 0:
            del self.cached[b]
            self.peak_used = max(self.peak_used, self.num_used)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        """One sequence less reads block b; at 0 it becomes cached (hashed) or free."""
        assert self.ref[b] > 0, f"block {b} released more often than taken"
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.hash_of:
                self.cached[b] = None
            else:
                self._free.add(b)
                heapq.heappush(self._heap, b)

    def register(self, b: int, h: int, tokens: Sequence[int]) -> bool:
        """Name used block b (full, committed prompt tokens) by hash h; False when another block has that name
        already (two requests computed the same prefix at once: b stays private)."""
        assert self.ref[b] > 0 and b not in self.hash_of and len(tokens) == self.block_size
        if h in self.by_hash:
            return False
        self.hash_of[b] = (h, tuple(tokens))
        self.by_hash[h] = b
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (each becomes free, its hash forgotten); False, changing nothing, while any block
        is in a block table (a running sequence may share hashed blocks, and new ones are named as prompts finish)."""
        if self.num_used:
            return False
        self._free.update(self.cached)
        self.cached.clear()
        self.hash_of.clear()
        self.by_hash.clear()
        self._heap = sorted(self._free)  # a sorted list is a heap
        return True

    def check(self, refs: dict[int, int]) -> None:
        """Invariants, given how many block tables hold each block."""
        for b in range(self.num_blocks):
            assert self.ref[b] == refs.get(b, 0), f"block {b}: refcount {self.ref[b]} but {refs.get(b, 0)} tables"
            places = (b in self._free) + (b in self.cached) + (self.ref[b] > 0)
            assert places == 1, f"block {b} is in {places} of free / cached / used"
            assert (b in self.cached) <= (b in self.hash_of), f"cached block {b} has no hash"
            assert b not in self._free or b not in self.hash_of, f"free block {b} has a hash"
        assert all(self.by_hash[h] == b for b, (h, _) in self.hash_of.items()), "hash map out of step"
        assert len(self.by_hash) == len(self.hash_of)
