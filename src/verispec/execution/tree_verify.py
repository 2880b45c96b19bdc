"""Verification of a tree draft against the target, as pure functions (SpecInfer, Miao et al. 2024; EAGLE-2).

Notation as in verify.py and tree.py: one target forward over [root, node 0..N-1] gives p_0..p_N, p_0 for the
root's children and p_{1+i} for node i's. Verification walks down from the root:

  greedy   - move to the child whose token is argmax p at the current node; where none is, emit that argmax.
  sampling - at the current node, with r = p: try its children in order. A child x drawn from its row q (siblings
             i.i.d. from one q, or drawn without replacement, each row q without the earlier siblings,
             renormalised) is accepted with probability min(1, r(x) / q(x)); a deterministic child (a point
             mass) with probability r(x). On a rejection r becomes the residual norm(max(0, r - q)) (for a point
             mass: r without x, renormalised) and the next sibling is tried against it. On an acceptance the walk
             moves to that child with r = its own p. When no child is accepted, or the node is a leaf, one token is
             drawn from r.
The sampled walk keeps the target's distribution exactly (SpecInfer's multi-step speculative sampling; without
replacement, Recursive Speculative Decoding's; the point-mass case is the same rule with q one-hot). A path of n
nodes emits n + 1 tokens.

  seeded   - (a seeded request) at the current node of depth d, the target's token is the race token of absolute
             position `position` + d (sampling/coupled.py); move to the child with that token, or emit it where
             no child has it. The output is the one plain seeded decoding gives, whatever the tree held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.sampling import SamplingParams, argmax_rows, sample_index, target_probs
from verispec.sampling.coupled import race_index
from verispec.execution.verify import residual
from verispec.models.tree import TreeDraft, children


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # the accepted nodes, root's child first: len(path) = n
    tokens: list[int]  # their tokens, then the recovered or bonus token: n + 1 tokens

    @property
    def accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(tree: TreeDraft, target_logits: torch.Tensor) -> TreeVerdict:
    """target_logits: [N + 1, V]. The longest root path whose tokens are the target's argmax at every step."""
    best = argmax_rows(target_logits)  # [N + 1]
    kids = children(tree.parents)
    path: list[int] = []
    row = 0
    while True:
        nxt = next((c for c in kids[row] if tree.tokens[c] == best[row]), None)
        if nxt is None:
            return TreeVerdict(path, [tree.tokens[c] for c in path] + [best[row]])
        path.append(nxt)
        row = nxt + 1


def verify_tree_sampled(tree: TreeDraft, p: torch.Tensor, generator: torch.Generator) -> TreeVerdict:
    """p: [N + 1, V] target distributions per query row. One uniform per tried child, one categorical draw."""
    kids = children(tree.parents)
    path: list[int] = []
    row = 0
    while True:
        r = p[row]  # [V]
        for c in kids[row]:
            x = tree.tokens[c]
            q = None if tree.probs is None else tree.probs[c]  # [V] or a point mass at x
            q_x = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * q_x <= float(r[x]):  # accept with probability min(1, r(x) / q(x)); q(x) > 0 since x ~ q
                path.append(c)
                row = c + 1
                break
            r = residual(r, q, x)
        else:  # no child accepted, or a leaf: the last token comes from what is left
            extra = sample_index(r, generator)
            return TreeVerdict(path, [tree.tokens[c] for c in path] + [extra])


def verify_tree_seeded(tree: TreeDraft, p: torch.Tensor, seed: int, position: int) -> TreeVerdict:
    """p: [N + 1, V] target distributions per query row; the root's row predicts absolute position `position`.
    Follows the children whose token is the race token of their position (the first such sibling)."""
    kids = children(tree.parents)
    path: list[int] = []
    row = 0
    while True:
        x = race_index(p[row], seed, position + len(path))
        nxt = next((c for c in kids[row] if tree.tokens[c] == x), None)
        if nxt is None:
            return TreeVerdict(path, [tree.tokens[c] for c in path] + [x])
        path.append(nxt)
        row = nxt + 1


def verify_tree(tree: TreeDraft, logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None, position: int | None = None) -> TreeVerdict:
    """One request's verdict. logits: [N + 1, V] the target's raw logits over [root, nodes]; position: the absolute
    position of the token the root's row predicts. Greedy compares with the argmax of the raw logits; sampling with
    the request's processed distribution (what plain decoding draws from): seeded by the race, else SpecInfer's
    walk with the request's generator."""
    if params.greedy:
        return verify_tree_greedy(tree, logits)
    p = target_probs(logits, params.temperature, params.top_k, params.top_p)  # [N + 1, V]
    if params.seed is not None:
        if position is None:
            raise ValueError("a seeded request's verdict needs the position of the token it samples")
        return verify_tree_seeded(tree, p, params.seed, position)
    assert generator is not None, "a sampled request has its own generator"
    return verify_tree_sampled(tree, p, generator)
