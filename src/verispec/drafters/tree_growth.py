"""EAGLE-2's dynamic draft tree while it grows, for drafters that run a network per depth (EAGLE-3's head, a draft
model): every candidate node (token, parent, depth, cumulative draft log-probability), which nodes have been run
(their scratch K/V row and output), the frontier expanded next, and the final `budget` best nodes as a TreeDraft."""

from __future__ import annotations

from typing import Callable

import torch

from verispec.models.tree import TreeDraft

TREE_TOPK = 4  # children considered per expanded node (EAGLE-2's top-k)
NODES_PER_WIDTH = 16  # budget nodes per node expanded at each depth


def frontier_width(budget: int) -> int:
    """Nodes expanded per depth for a tree of `budget` nodes: one per NODES_PER_WIDTH, at least one, at most
    TREE_TOPK. EAGLE-2 expands its top-k at every depth; for the budgets a CPU verifies (4-8 nodes) the shipped
    EAGLE-3 head's replayed tau was the same with 1, 2 or 4 (benchmarks/tree_acceptance.py, 2026-12-03: within
    0.05 on every workload), while each extra node is one more row through the head at every depth."""
    return max(1, min(TREE_TOPK, budget // NODES_PER_WIDTH))


class Growth:
    def __init__(self, first_row: int, width: int) -> None:
        self.token: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.score: list[float] = []
        self.row: dict[int, int] = {}  # run node -> its scratch K/V row (drafters that keep one)
        self.out: dict[int, torch.Tensor] = {}  # run node -> its output [1, d] (drafters that feed it on)
        self.next_row, self.width = first_row, width
        self._newest: list[int] = []

    def expand(self, parents: list[int], logp: torch.Tensor,
               to_ids: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """The TREE_TOPK most probable tokens after each of `parents` (-1: the root), one top-k over all their rows.
        logp: [len(parents), V'] log-probabilities; `to_ids` maps its indices to token ids (a reduced draft
        vocabulary), else the index is the token."""
        vals, idx = logp.topk(min(TREE_TOPK, logp.shape[-1]), dim=-1)  # [w, k]
        toks = (idx if to_ids is None else to_ids(idx)).tolist()
        for parent, row_vals, row_toks in zip(parents, vals.tolist(), toks):
            base = 0.0 if parent < 0 else self.score[parent]
            d = 1 if parent < 0 else self.depth[parent] + 1
            for val, tok in zip(row_vals, row_toks):
                self.token.append(int(tok))
                self.parent.append(parent)
                self.depth.append(d)
                self.score.append(base + val)
                self._newest.append(len(self.token) - 1)

    def frontier(self) -> list[int]:
        """The `width` most probable of the newest children: the nodes expanded next."""
        new, self._newest = self._newest, []
        return sorted(new, key=lambda i: (-self.score[i], i))[: self.width]

    def path(self, i: int) -> list[int]:
        """Node i and its ancestors."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.parent[i]
        return out

    def best(self, budget: int) -> TreeDraft:
        """The `budget` most probable nodes (ties: shallower, then earlier), parents listed first. Ancestor-closed:
        a path's cumulative log-probability never grows, so a kept node's parent scores at least as high."""
        keep = sorted(range(len(self.token)), key=lambda i: (-self.score[i], self.depth[i], i))[:budget]
        keep.sort(key=lambda i: (self.depth[i], i))
        index = {n: j for j, n in enumerate(keep)}
        return TreeDraft(tuple(self.token[i] for i in keep),
                         tuple(-1 if self.parent[i] < 0 else index[self.parent[i]] for i in keep))
