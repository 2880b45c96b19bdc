"""Draft trees: the shape of a tree draft and what one target forward over it needs (pure, no model).

A tree draft hangs below the request's pending token (the root, which is already the target's). Its N nodes are
listed parents before children; node i holds token `tokens[i]` and hangs below node `parents[i]` (-1: the root).
The target forward runs over [root, node 0, ..., node N-1]: N + 1 query rows. Row 0 gives the target's
distribution for the root's children, row 1 + i the one for node i's children (or the bonus after a leaf).

Each query row sees the committed context, itself and its ancestors, never a sibling or a cousin: `ancestor_mask`.
Its RoPE position is the root's position plus its depth: `depths`. A chain is the tree whose node i hangs below
node i - 1, and then the mask is the ordinary causal one and the positions consecutive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class TreeDraft:
    """tokens, parents: [N]. probs: [N, V] the distribution each node was drawn from, or None.

    With probs, the children of one node are independent draws from that one distribution (duplicates kept: they
    are what makes the multi-draft rule exact); without, they are distinct tokens chosen deterministically
    (top-k of a drafter, n-gram continuations) and verification treats each as a point mass.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents), "one parent per node"
        for i, par in enumerate(self.parents):
            assert -1 <= par < i, f"node {i}: its parent {par} must come before it (-1 is the root)"
        if self.probs is not None:
            assert self.probs.shape[0] == len(self.tokens), "one draft distribution per node"
        else:
            for node, kids in enumerate(children(self.parents)):
                toks = [self.tokens[k] for k in kids]
                assert len(set(toks)) == len(toks), f"deterministic siblings below {node - 1} must be distinct"

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: torch.Tensor | None = None) -> "TreeDraft":
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), probs)

    def __len__(self) -> int:
        return len(self.tokens)


def children(parents: Sequence[int]) -> list[list[int]]:
    """[N + 1] lists: entry 0 the root's children, entry 1 + i node i's, each in node order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, par in enumerate(parents):
        out[par + 1].append(i)
    return out


def depths(parents: Sequence[int]) -> list[int]:
    """[N + 1] depth of each query row: 0 for the root, 1 for its children, ..."""
    d = [0]
    for par in parents:
        d.append(d[par + 1] + 1)
    return d


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[N + 1, N + 1] bool: row a may attend to row b of the tree block (b is a itself or an ancestor of a)."""
    n = len(parents) + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[0, 0] = True
    for i, par in enumerate(parents):
        mask[i + 1] = mask[par + 1]
        mask[i + 1, i + 1] = True
    return mask


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (-1: the empty path)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]
