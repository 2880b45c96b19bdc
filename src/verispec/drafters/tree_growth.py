"""EAGLE-2's dynamic draft tree while it grows, for drafters that run a network per depth (EAGLE-3's head, a draft
model): every candidate node (token, parent, depth, cumulative draft log-probability), which nodes have been run
(their scratch K/V row and output), the frontier expanded next, and the final `budget` best nodes as a TreeDraft.

Sampled requests draw each node's children without replacement from the drafter's q (`draw_distinct`): each child
carries the distribution it was drawn from, the verifier's multi-draft rule takes them as they come, and the first
child is accepted as often as a chain's token (1 - TV(p, q)) where a top-k child (a point mass) is accepted with p of
it alone. A sampled child is scored by its rank's draft probability (the j-th largest of q), never by its own token:
then the siblings a tree keeps are always the first ones drawn, and which are kept never depends on what a kept one
drew (scoring by its own q would keep the lucky draws and bias the verified distribution)."""

from __future__ import annotations

from typing import Callable

import torch

from verispec.models.tree import TreeDraft
from verispec.sampling import DraftSampler
from verispec.sampling.coupled import race_top

TREE_TOPK = 4  # children considered per expanded node (EAGLE-2's top-k)
NODES_PER_WIDTH = 16  # budget nodes per node expanded at each depth


def frontier_width(budget: int) -> int:
    """Nodes expanded per depth for a tree of `budget` nodes: one per NODES_PER_WIDTH, at least one, at most
    TREE_TOPK. EAGLE-2 expands its top-k at every depth; for the budgets a CPU verifies (4-8 nodes) the shipped
    EAGLE-3 head's replayed tau was the same with 1, 2 or 4 (benchmarks/studies/tree_acceptance.py: within
    0.05 on every workload), while each extra node is one more row through the head at every depth."""
    return max(1, min(TREE_TOPK, budget // NODES_PER_WIDTH))


def draw_distinct(q: torch.Tensor, m: int, generator: torch.Generator | None, cdf: torch.Tensor | None = None
                  ) -> tuple[list[int], torch.Tensor]:
    """Up to m distinct tokens drawn one after another from q [V] without replacement (each from q without the
    earlier ones, renormalised; fewer where q has fewer nonzero entries) and the distribution each was drawn from,
    [m', V] (Recursive Speculative Decoding, Jeon et al. 2024: with these rows the multi-draft rule stays exact).

    One float64 running sum for all draws, as `sample_rows` draws one token: the j-th uniform is spread over the
    mass not yet drawn and carried past the drawn tokens' intervals (four draws over a 49,152-token vocabulary: about
    a third of the time of a running sum per draw). cdf: q's float64 running sum where the caller keeps it for
    several draws from one q."""
    cdf = q.double().cumsum(0) if cdf is None else cdf  # [V]
    total = float(cdf[-1])
    u = torch.rand(m, dtype=torch.float64, generator=generator, device=q.device).tolist()
    tokens: list[int] = []
    drawn: list[tuple[float, float]] = []  # (where a drawn token's interval starts, its mass), by start
    for j in range(m):
        left = total - sum(mass for _, mass in drawn)
        if left <= total * 1e-12:  # nothing left to draw (or only rounding)
            break
        x = u[j] * left
        for start, mass in drawn:  # to the running sum's scale: skip the drawn intervals at or before x
            if start > x:
                break
            x += mass
        t = min(int(torch.searchsorted(cdf, torch.tensor([x], dtype=torch.float64, device=q.device),
                                       right=True)), q.shape[0] - 1)
        if t in tokens or float(q[t]) <= 0.0:  # only rounding at an interval's edge can land here
            break
        tokens.append(t)
        lo = float(cdf[t - 1]) if t else 0.0
        drawn = sorted(drawn + [(lo, float(cdf[t]) - lo)])
    return tokens, _without_earlier(q, tokens)


def _without_earlier(q: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """[m', V]: row j is q [V] without tokens[:j], renormalised (the distribution the j-th distinct draw came from)."""
    if not tokens:
        return q.new_zeros((0, q.shape[-1]))
    rows = q.expand(len(tokens), -1).clone()  # [m', V]
    for j in range(1, len(tokens)):
        rows[j:, tokens[j - 1]] = 0.0
    return rows / rows.sum(-1, keepdim=True)


def draw_children(q: torch.Tensor, m: int, sampler: DraftSampler, position: int, cdf: torch.Tensor | None = None
                  ) -> tuple[list[int], torch.Tensor]:
    """A sampled node's up to m children at absolute `position` and the rows they were drawn from: coupled (a seeded
    request) the top-m of q / E over the position's noise (Gumbel top-k, sampling/coupled.py: the first child is the
    coupled draw, together a draw without replacement from q), else `draw_distinct` from the drafter's stream."""
    if not sampler.coupled:
        return draw_distinct(q, m, sampler.generator, cdf)
    tokens = race_top(q, m, sampler.seed, position)  # type: ignore[arg-type]
    return tokens, _without_earlier(q, tokens)


class Growth:
    def __init__(self, first_row: int, width: int, origin: int = 0) -> None:
        self.origin = origin  # the absolute position of the root's children (a depth-d node's: origin + d - 1)
        self.token: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.score: list[float] = []
        self.row: dict[int, int] = {}  # run node -> its scratch K/V row (drafters that keep one)
        self.out: dict[int, torch.Tensor] = {}  # run node -> its output [1, d] (drafters that feed it on)
        self.q: dict[int, torch.Tensor] = {}  # sampled node -> the distribution [V] it was drawn from
        self.next_row, self.width = first_row, width
        self._newest: list[int] = []

    def expand(self, parents: list[int], logp: torch.Tensor,
               to_ids: Callable[[torch.Tensor], torch.Tensor] | None = None, q: torch.Tensor | None = None,
               sampler: DraftSampler | None = None) -> None:
        """TREE_TOPK children below each of `parents` (-1: the root), scored by the top-k of each row of `logp`
        ([len(parents), V'] log-probabilities; `to_ids` maps its indices to token ids, a reduced draft vocabulary).
        Greedy (q None) the children are those top-k tokens. Sampled, q [len(parents), V] is what each parent's
        children are drawn from by `sampler` (`draw_children`), the j-th drawn scored by the j-th largest of logp's
        row."""
        vals, idx = logp.topk(min(TREE_TOPK, logp.shape[-1]), dim=-1)  # [w, k]
        if q is None:
            draws = [(toks, None) for toks in (idx if to_ids is None else to_ids(idx)).tolist()]
        else:
            assert sampler is not None, "sampled children need the request's draft sampler"
            draws = [draw_children(row, vals.shape[-1], sampler, self.origin + (0 if par < 0 else self.depth[par]))
                     for par, row in zip(parents, q)]
        for parent, row_vals, (row_toks, rows) in zip(parents, vals.tolist(), draws):
            base = 0.0 if parent < 0 else self.score[parent]
            d = 1 if parent < 0 else self.depth[parent] + 1
            for j, (val, tok) in enumerate(zip(row_vals, row_toks)):
                self.token.append(int(tok))
                self.parent.append(parent)
                self.depth.append(d)
                self.score.append(base + val)
                self._newest.append(len(self.token) - 1)
                if rows is not None:
                    self.q[len(self.token) - 1] = rows[j]

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

    def kept(self, budget: int) -> list[int]:
        """The `budget` most probable nodes (ties: shallower, then earlier), parents listed first. Ancestor-closed:
        a path's cumulative log-probability never grows, so a kept node's parent scores at least as high."""
        keep = sorted(range(len(self.token)), key=lambda i: (-self.score[i], self.depth[i], i))[:budget]
        return sorted(keep, key=lambda i: (self.depth[i], i))

    def best(self, budget: int) -> TreeDraft:
        """The `kept` nodes as a TreeDraft (with the rows sampled nodes were drawn from)."""
        keep = self.kept(budget)
        index = {n: j for j, n in enumerate(keep)}
        return TreeDraft(tuple(self.token[i] for i in keep),
                         tuple(-1 if self.parent[i] < 0 else index[self.parent[i]] for i in keep),
                         torch.stack([self.q[i] for i in keep]) if keep and self.q else None)
