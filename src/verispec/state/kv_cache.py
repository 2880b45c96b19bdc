"""Preallocated per-sequence KV cache with commit / rollback by length.

Layout: one tensor per layer for keys and one for values, shape [num_slots, num_kv_heads, max_len, head_dim].
A sequence owns one slot. The KV of position p lives at index p, so rolling back is only a length change:
rejected positions stay in memory but are never read again, and the next block overwrites them.

Per slot, two counters:
  length  - committed positions, all of them visible to later forwards;
  pending - positions written by the last forward but not yet committed (a draft block being verified).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Sequence

import torch

from verispec.kernels.cpu import memory_available


def zeroed(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor whose CPU memory is only taken as it is written: an anonymous mapping's pages are zero until
    first touched, where torch.zeros writes every byte at once. A cache sized for every sequence at its longest
    (the default engine's: 754 MB of K/V for the default model) then costs the process the positions in use, not
    its capacity. Huge pages are declined for it: each sequence's first block per head would fault in 2 MB (the
    layout puts the heads' spans megabytes apart). Zero bits are 0.0 in every float format."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, n)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(*shape)  # keeps `pages` alive


def check_fits(nbytes: int, device: torch.device | str, how: str) -> None:
    """A CPU cache of `nbytes` larger than the memory the machine has available fails here, naming `how` it was
    sized, not later: its pages are only taken as positions are written (`zeroed`), so such a cache would start,
    then be killed for memory under load."""
    if torch.device(device).type != "cpu":
        return
    available = memory_available()
    if available is not None and nbytes > available:
        raise ValueError(f"the KV cache needs {nbytes / 2**30:.2f} GiB ({how}) but this machine has "
                         f"{available / 2**30:.2f} GiB available: lower kv_cache_memory_bytes, max_model_len or "
                         f"max_num_seqs")


def rows_move(rows: Sequence[int], pending: int) -> bool:
    """Check `rows` (for `commit_rows`: increasing offsets into an open block of `pending` positions) and say
    whether keeping them moves any, i.e. they are not the block's first len(rows)."""
    assert list(rows) == sorted(set(rows)) and all(0 <= r < pending for r in rows), f"rows {rows} of {pending}"
    return list(rows) != list(range(len(rows)))


class CacheFullError(RuntimeError):
    """A sequence would grow past the cache's max_len."""


@dataclass
class SlotState:
    length: int = 0
    pending: int = 0
    in_use: bool = False


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        num_slots: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_len <= 0 or num_slots <= 0:
            raise ValueError("max_len and num_slots must be positive")
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.v = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.max_len = max_len
        self.slots = [SlotState() for _ in range(num_slots)]

    # ---- slot ownership -------------------------------------------------------------------------
    def allocate(self) -> int:
        for i, s in enumerate(self.slots):
            if not s.in_use:
                self.slots[i] = SlotState(in_use=True)
                return i
        raise CacheFullError(f"all {len(self.slots)} cache slots are in use")

    def free(self, slot: int) -> None:
        self.slots[slot] = SlotState()

    def length(self, slot: int) -> int:
        return self.slots[slot].length

    @property
    def span(self) -> int:
        """Positions per slot along a layer's position axis (the paged cache's: its whole pool)."""
        return self.max_len

    def bytes_used(self) -> int:
        per_pos = sum(t[0, :, 0].numel() * t.element_size() for t in self.k + self.v)
        return per_pos * sum(s.length for s in self.slots)

    # ---- the block protocol: reserve -> (forward writes) -> commit / rollback -------------------
    def reserve(self, slot: int, n: int) -> int:
        """Open a block of n new positions after the committed ones; returns its first position."""
        s = self.slots[slot]
        assert s.in_use, f"slot {slot} is not allocated"
        assert s.pending == 0, f"slot {slot} has an unresolved block of {s.pending} positions; commit first"
        if s.length + n > self.max_len:
            raise CacheFullError(
                f"sequence needs {s.length + n} positions but the cache holds {self.max_len}; "
                "raise max_model_len or shorten the request"
            )
        s.pending = n
        return s.length

    def commit(self, slot: int, n: int) -> None:
        """Keep the first n positions of the open block; the rest become invisible."""
        s = self.slots[slot]
        assert 0 <= n <= s.pending, f"commit {n} of a block of {s.pending}"
        s.length += n
        s.pending = 0

    def commit_rows(self, slot: int, rows: Sequence[int]) -> None:
        """Keep rows `rows` of the open block (increasing offsets into it: a draft tree's root and accepted path),
        moved to its first len(rows) positions, and commit them; the rest become invisible."""
        s = self.slots[slot]
        if rows_move(rows, s.pending):
            src = torch.tensor([s.length + r for r in rows], device=self.k[0].device)  # [n]
            for t in self.k + self.v:  # the gather copies first: a moved row never overwrites one still to move
                t[slot, :, s.length : s.length + len(rows)] = t[slot].index_select(1, src)
        self.commit(slot, len(rows))

    def rollback(self, slot: int, length: int) -> None:
        """Forget everything from position `length` on (committed or pending)."""
        s = self.slots[slot]
        assert 0 <= length <= s.length, f"rollback to {length} past committed length {s.length}"
        s.length = length
        s.pending = 0

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v: [num_kv_heads, n, head_dim] at positions start .. start+n-1 of the open block."""
        s = self.slots[slot]
        n = k.shape[1]
        assert start == s.length and n == s.pending, "write must cover exactly the reserved block"
        self.k[layer][slot, :, start : start + n] = k
        self.v[layer][slot, :, start : start + n] = v

    def kv_rows(self, segments: Sequence, device: torch.device) -> torch.Tensor:
        """[N K] rows of a layer viewed as [slots K T, hd] that the segments' N new tokens' K/V go to, token-major."""
        K = self.k[0].shape[1]
        slot = torch.tensor([s.slot for s in segments for _ in range(s.length)])
        pos = torch.tensor([p for s in segments for p in range(s.start, s.start + s.length)])
        return ((slot[:, None] * K + torch.arange(K)) * self.max_len + pos[:, None]).reshape(-1).to(device)

    def read(self, layer: int, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of positions 0 .. n-1: [num_kv_heads, n, head_dim] each (views)."""
        return self.k[layer][slot, :, :n], self.v[layer][slot, :, :n]
