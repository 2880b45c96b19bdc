"""Paged KV cache: K/V in fixed-size blocks of a shared pool, a block table per sequence, prefix sharing.

Layout: per layer one tensor for keys and one for values, [1, num_kv_heads, num_blocks * B, head_dim]: the blocks
lie one after another along the position axis of each head. Position p of a sequence lives at physical position
table[p // B] * B + p % B, row `head * span + that` of the layer viewed as [K span, hd] (span = num_blocks B).
Blocks that are physically consecutive are one slice of that axis, so a sequence whose blocks are consecutive (a
lone request always is: the pool hands out the block after a sequence's last one when it is free) is read as a
view, as in the slot cache; anything else is gathered (models/attention.py).

The block protocol is the slot cache's: reserve n positions (blocks for them taken from the pool), the forward
writes them, commit the accepted ones; blocks that then hold only rejected positions go back to the pool. Memory
is the blocks in use, not slots x max_len.

Prefix caching: a sequence allocated with its prompt names each full, committed block of its prompt by a hash
chain (state/block_pool.py); a later sequence whose prompt starts with the same blocks takes them (reference
counted) and starts computing after them. Shared (hashed) blocks are never written again: a sequence's first
non-shared position starts a fresh block. A finished sequence names its output's full blocks as well
(`register_tokens`), so the next turn of a chat, whose prompt repeats the answer, finds them. Where an engine's
drafter reads the target's hidden states, `features` (state/block_features.py) keeps them beside the K/V and a
hit takes only blocks whose features are whole. Counters: prefix_queries / prefix_hits in prompt tokens, since the
cache was made (a reset of the prefix cache keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from verispec.config import DEFAULT_BLOCK_SIZE
from verispec.state.block_features import BlockFeatures
from verispec.state.block_pool import ROOT, BlockPool, BlocksExhausted, block_hash
from verispec.state.kv_cache import CacheFullError, rows_move, zeroed


class OutOfBlocks(CacheFullError):
    """The pool has too few free blocks for a reservation (the engine preempts before this can happen)."""


@dataclass
class SeqState:
    """One sequence's view of the pool (the slot cache's `SlotState` plus its block table)."""

    length: int = 0  # committed positions
    pending: int = 0  # reserved, written by the forward, not yet committed
    in_use: bool = False
    blocks: list[int] = field(default_factory=list)  # the block table: logical block i -> physical block
    prompt: tuple[int, ...] = ()  # tokens whose full blocks may be shared once committed
    hashes: list[int] = field(default_factory=list)  # hash of each shared / registered leading block
    target: int | torch.Tensor = 0  # where the open block's positions lie: first physical position (consecutive)
    # or [pending] physical positions; worked out once per reservation, read by every layer's write


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, num_blocks: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_slots: int = 1, prefix_caching: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if max_len <= 0 or num_slots <= 0:
            raise ValueError("max_len and num_slots must be positive")
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size, self.max_len, self.prefix_caching = block_size, max_len, prefix_caching
        self.span = num_blocks * block_size  # positions per head along the pool's axis
        shape = (1, num_kv_heads, self.span, head_dim)
        self.k = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.v = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.slots = [SeqState() for _ in range(num_slots)]
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of them, found
        self.features: BlockFeatures | None = None  # drafter features beside the K/V (`write_features`)

    # ---- sequences --------------------------------------------------------------------------------------------
    def match(self, prompt: Sequence[int], limit: int, layers: tuple[int, ...] | None = None) -> list[int]:
        """The cached blocks that hold the first full blocks of `prompt`, at most `limit` positions' worth; with
        `layers`, only as far as the blocks hold those layers' features whole."""
        B, parent, out = self.block_size, ROOT, []
        if not self.prefix_caching:
            return out
        feats = self.features if layers is not None else None  # where set, hits stop at a block not whole in it
        if layers is not None and (feats is None or feats.layers != layers):
            return out  # nothing kept for these layers
        for i in range(min(limit, len(prompt)) // B):
            parent = block_hash(parent, prompt[i * B : (i + 1) * B])
            b = self.pool.lookup(parent, prompt[i * B : (i + 1) * B])
            if b is None or (feats is not None and not feats.whole(b)):
                break
            out.append(b)
        return out

    def allocate(self, prompt: Sequence[int] = (), prefix: Sequence[int] = (), queried: int = 0) -> int:
        """A sequence id (slot) for a new sequence that starts with the blocks `prefix` (from `match`, already
        computed: its length starts after them); `prompt`'s full blocks become shareable as they are committed.
        `queried`: the prompt tokens the prefix lookup covered (the hit counters' denominator)."""
        for i, s in enumerate(self.slots):
            if not s.in_use:
                break
        else:
            raise CacheFullError(f"all {len(self.slots)} sequences of the cache are in use")
        B, parent, hashes = self.block_size, ROOT, []
        for j, b in enumerate(prefix):
            parent = block_hash(parent, prompt[j * B : (j + 1) * B])
            assert self.pool.lookup(parent, prompt[j * B : (j + 1) * B]) == b, f"block {b} is not prompt block {j}"
            hashes.append(parent)
        for b in prefix:
            self.pool.acquire(b)
        self.slots[i] = SeqState(len(prefix) * B, 0, True, list(prefix), tuple(prompt) if self.prefix_caching
                                 else (), hashes)
        self.prefix_queries += queried
        self.prefix_hits += len(prefix) * B
        return i

    def register_tokens(self, slot: int, tokens: Sequence[int]) -> None:
        """Name the sequence's full, committed blocks by `tokens` (its prompt and output so far, which start with
        the prompt it was allocated with), not only its prompt's: called as it finishes, before `free`."""
        s = self.slots[slot]
        if s.prompt and len(tokens) > len(s.prompt) and tuple(tokens[: len(s.prompt)]) == s.prompt:
            s.prompt = tuple(tokens)
            self._register(s)

    def write_features(self, layers: tuple[int, ...], slot: int, start: int, feats: torch.Tensor) -> None:
        """Keep feats [n, F], the captured states of target `layers` at committed positions start .. start+n-1
        (a store of other layers is replaced: its blocks no longer serve a drafter)."""
        if self.features is None or self.features.layers != layers:
            self.features = BlockFeatures(self.pool.num_blocks, self.block_size, layers)
        self.features.write(self._physical(self.slots[slot], start, feats.shape[0]), feats)

    def read_features(self, slot: int, n: int) -> torch.Tensor:
        """[n, F] the kept features of the sequence's positions 0 .. n-1 (shared blocks `match` found whole)."""
        assert self.features is not None
        return self.features.read(self._physical(self.slots[slot], 0, n))

    def free(self, slot: int) -> None:
        """Release the sequence's blocks (last block first, so the prefix cache evicts tails before heads)."""
        s = self.slots[slot]
        for b in reversed(s.blocks):
            self.pool.release(b)
        self.slots[slot] = SeqState()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (vLLM's reset); False, changing nothing, while any sequence holds blocks.
        The hit counters stay lifetime totals (the server publishes them as Prometheus counters, which never go
        back): a caller wanting one run's hit rate takes their difference across it."""
        return self.pool.reset_prefix_cache()

    def length(self, slot: int) -> int:
        return self.slots[slot].length

    def table(self, slot: int) -> list[int]:
        return self.slots[slot].blocks

    def blocks_needed(self, slot: int, n: int) -> int:
        """New blocks a reservation of n more positions would take."""
        s = self.slots[slot]
        return max(0, -(-(s.length + n) // self.block_size) - len(s.blocks))

    def bytes_per_block(self) -> int:
        return sum(t[0, :, : self.block_size].numel() * t.element_size() for t in self.k + self.v)

    def bytes_used(self) -> int:
        return self.bytes_per_block() * self.pool.num_used

    # ---- the block protocol: reserve -> (forward writes) -> commit / rollback --------------------------------
    def reserve(self, slot: int, n: int) -> int:
        """Open a block of n new positions after the committed ones (taking blocks for them); its first position."""
        s = self.slots[slot]
        assert s.in_use, f"sequence {slot} is not allocated"
        assert s.pending == 0, f"sequence {slot} has an unresolved block of {s.pending} positions; commit first"
        if s.length + n > self.max_len:
            raise CacheFullError(f"sequence needs {s.length + n} positions but the context is {self.max_len}; "
                                 "raise max_model_len or shorten the request")
        need = self.blocks_needed(slot, n)
        if need > self.pool.num_free:
            raise OutOfBlocks(f"sequence {slot} needs {need} more KV blocks but {self.pool.num_free} are free")
        try:
            for _ in range(need):
                s.blocks.append(self.pool.take(s.blocks[-1] if s.blocks else None))
                if self.features is not None:
                    self.features.fresh(s.blocks[-1])
        except BlocksExhausted as e:  # unreachable after the count above; keep the state whole anyway
            self._trim(s, s.length)
            raise OutOfBlocks(str(e)) from e
        self._check_private(s, s.length, n)
        s.pending = n
        phys = self._physical(s, s.length, n)  # Python ints: a decode step reserves a row or a few per sequence
        a = phys[0] if n else 0
        s.target = a if phys == list(range(a, a + n)) else torch.tensor(phys, device=self.k[0].device)
        return s.length

    def commit(self, slot: int, n: int) -> None:
        """Keep the first n positions of the open block; the rest become invisible and blocks holding only them
        go back to the pool. Newly full prompt blocks get their hash (shareable from now on)."""
        s = self.slots[slot]
        assert 0 <= n <= s.pending, f"commit {n} of a block of {s.pending}"
        s.length += n
        s.pending = 0
        self._trim(s, s.length)
        self._register(s)

    def commit_rows(self, slot: int, rows: Sequence[int]) -> None:
        """Keep rows `rows` of the open block (increasing offsets into it: a draft tree's root and accepted path),
        moved to its first len(rows) positions, and commit them; the rest become invisible (blocks holding only
        them go back to the pool). The open block is private (`reserve` checked), so moving within it is safe."""
        s = self.slots[slot]
        if rows_move(rows, s.pending):
            phys = self.positions(slot, s.length, s.pending).to(self.k[0].device)  # [pending]
            src, dst = phys[list(rows)], phys[: len(rows)]
            for t in self.k + self.v:  # the gather copies first: a moved row never overwrites one still to move
                t[0].index_copy_(1, dst, t[0].index_select(1, src))
        self.commit(slot, len(rows))

    def rollback(self, slot: int, length: int) -> None:
        """Forget everything from position `length` on (committed or pending); shared blocks stay."""
        s = self.slots[slot]
        assert 0 <= length <= s.length, f"rollback to {length} past committed length {s.length}"
        assert length >= len(s.hashes) * self.block_size, "rollback into a shared (hashed) block"
        s.length = length
        s.pending = 0
        self._trim(s, length)

    def _trim(self, s: SeqState, length: int) -> None:
        keep = -(-length // self.block_size)
        while len(s.blocks) > keep:
            self.pool.release(s.blocks.pop())

    def _register(self, s: SeqState) -> None:
        """Hash the sequence's full, committed prompt blocks not hashed yet (a chain: stops at the first block some
        other sequence registered first, which stays private here)."""
        B = self.block_size
        full = min(s.length, len(s.prompt)) // B
        while len(s.hashes) < full:
            j = len(s.hashes)
            tokens = s.prompt[j * B : (j + 1) * B]
            h = block_hash(s.hashes[-1] if s.hashes else ROOT, tokens)
            if not self.pool.register(s.blocks[j], h, tokens):
                s.prompt = ()  # the chain is broken here: no later block of this sequence is shareable
                return
            s.hashes.append(h)

    # ---- where positions live -------------------------------------------------------------------------------
    def positions(self, slot: int, start: int, n: int) -> torch.Tensor:
        """[n] physical positions (along the pool's axis) of the sequence's positions start .. start+n-1."""
        return torch.tensor(self._physical(self.slots[slot], start, n), dtype=torch.long)

    def _physical(self, s: SeqState, start: int, n: int) -> list[int]:
        """`positions` as Python ints."""
        B, table = self.block_size, s.blocks
        return [table[p // B] * B + p % B for p in range(start, start + n)]

    def kv_rows(self, segments: Sequence, device: torch.device) -> torch.Tensor:
        """[N K] rows of a layer viewed as [K span, hd] that the segments' N new tokens' K/V go to, token-major."""
        K = self.k[0].shape[1]
        phys = torch.cat([self.positions(s.slot, s.start, s.length) for s in segments])  # [N]
        return (torch.arange(K) * self.span + phys[:, None]).reshape(-1).to(device)

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v: [num_kv_heads, n, head_dim] at positions start .. start+n-1 of the open block."""
        s, n = self.slots[slot], k.shape[1]
        assert start == s.length and n == s.pending, "write must cover exactly the reserved block"
        if isinstance(s.target, int):  # consecutive blocks (private: `reserve` checked): one slice
            a = s.target
            self.k[layer][0, :, a : a + n] = k
            self.v[layer][0, :, a : a + n] = v
            return
        self.k[layer][0].index_copy_(1, s.target, k.to(self.k[layer].dtype))
        self.v[layer][0].index_copy_(1, s.target, v.to(self.v[layer].dtype))

    def _check_private(self, s: SeqState, start: int, n: int) -> None:
        B = self.block_size
        for j in range(start // B, -(-(start + n) // B)):
            b = s.blocks[j]
            assert self.pool.ref[b] == 1 and b not in self.pool.hash_of, f"write into shared block {b}"

    def read(self, layer: int, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed K and V of positions 0 .. n-1: [num_kv_heads, n, head_dim] each (a copy)."""
        index = self.positions(slot, 0, n).to(self.k[layer].device)
        return self.k[layer][0].index_select(1, index), self.v[layer][0].index_select(1, index)

    def check(self) -> None:
        """Every invariant: block tables sized to their positions, refcounts = table entries, shared prefixes."""
        refs: dict[int, int] = {}
        B = self.block_size
        for i, s in enumerate(self.slots):
            if not s.in_use:
                assert not s.blocks and s.length == 0 and s.pending == 0, f"free sequence {i} holds state"
                continue
            assert len(s.blocks) == -(-(s.length + s.pending) // B), f"sequence {i}: table / positions out of step"
            assert len(set(s.blocks)) == len(s.blocks), f"sequence {i} holds a block twice"
            assert len(s.hashes) * B <= s.length, f"sequence {i}: a hashed block is not full and committed"
            for j, h in enumerate(s.hashes):
                assert self.pool.hash_of.get(s.blocks[j], (None,))[0] == h, f"sequence {i}: block {j} lost its hash"
            for b in s.blocks:
                refs[b] = refs.get(b, 0) + 1
        self.pool.check(refs)
