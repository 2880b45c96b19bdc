"""Drafter features beside the paged cache's K/V, so that a prefix-cache hit skips them as well.

Learned drafters (EAGLE-3, DFlash, DSpark, MTP heads) read the target's hidden states at every committed position
(`add_features`, drafters/base.py). A request that takes cached prompt blocks computes neither their K/V nor their
hidden states, so without these its drafter would start blind. This store keeps, for each physical position of the
pool, the captured states of one set of target layers ([span, F] with F = len(layers) x d), and which positions
were written since their block was last handed out. A cached block serves a drafter only when all
of its positions are written for the same layers: a block computed while no drafter captured them (or captured
other layers, by another engine sharing the cache) is a prefix hit for plain requests and a miss here.

Positions are written when they are committed (prefill chunks and accepted decode rows alike); a block is whole
when every one of its positions is written. The features are what the forward captured, in its dtype: a drafter
fed from the store gets the same numbers as one fed by the forward that computed them (the engine runs
batch-invariant forwards, so they are also the numbers a fresh prefill would give).
"""

from __future__ import annotations

from typing import Sequence

import torch


class BlockFeatures:
    def __init__(self, num_blocks: int, block_size: int, layers: tuple[int, ...]) -> None:
        self.block_size, self.layers = block_size, layers
        self.written = bytearray(num_blocks * block_size)  # [span] 1 where the position's features are held
        self.rows: torch.Tensor | None = None  # [num_blocks * B, F], made at the first write (its F and dtype)

    def fresh(self, block: int) -> None:
        """Block `block` was handed out for new positions: nothing in it is written."""
        B = self.block_size
        self.written[block * B : (block + 1) * B] = bytes(B)

    def whole(self, block: int) -> bool:
        B = self.block_size
        return self.written.count(1, block * B, (block + 1) * B) == B

    def write(self, positions: Sequence[int], feats: torch.Tensor) -> None:
        """feats [n, F] of the n physical `positions`."""
        if self.rows is None:
            span = len(self.written)
            self.rows = torch.empty(span, feats.shape[1], dtype=feats.dtype, device=feats.device)
        assert feats.shape == (len(positions), self.rows.shape[1]), "features of another width"
        n, a = len(positions), positions[0] if positions else 0
        if list(positions) == list(range(a, a + n)):  # one slice: a decode step's rows, a chunk in one block run
            self.rows[a : a + n] = feats
            self.written[a : a + n] = b"\x01" * n
            return
        index = torch.tensor(list(positions), dtype=torch.long, device=self.rows.device)
        self.rows.index_copy_(0, index, feats.to(self.rows.dtype))
        for p in positions:
            self.written[p] = 1

    def read(self, positions: Sequence[int]) -> torch.Tensor:
        """[n, F] a copy of the features at the physical `positions` (all in whole blocks)."""
        assert self.rows is not None and all(self.whole(p // self.block_size) for p in positions)
        return self.rows[torch.tensor(list(positions), dtype=torch.long, device=self.rows.device)]
