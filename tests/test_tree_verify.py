"""Tree drafts: shape helpers against brute force, greedy tree verification against an enumeration of root paths,
and sampled tree verification against the closed-form distribution of a Markov target (chi-square), with a
negative control that must fail."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import chi2_pvalue
from verispec.drafters import tree_growth
from verispec.drafters.tree_growth import Growth, draw_distinct
from verispec.sampling import DraftSampler
from verispec.execution import tree_verify
from verispec.models.tree import TreeDraft, ancestor_mask, depths, path_to
from verispec.execution.tree_verify import verify_tree_greedy, verify_tree_sampled
from verispec.execution.verify import verify_greedy


def random_parents(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randint(-1, i - 1) for i in range(n))


def distinct_tokens(rng: random.Random, parents, vocab: int) -> tuple[int, ...]:
    """Tokens with distinct siblings (what a deterministic tree must have)."""
    used: dict[int, set[int]] = {}
    out = []
    for par in parents:
        free = [t for t in range(vocab) if t not in used.setdefault(par, set())]
        t = rng.choice(free)
        used[par].add(t)
        out.append(t)
    return tuple(out)


@pytest.mark.parametrize("seed", range(20))
def test_mask_and_depths_follow_the_parent_links(seed):
    rng = random.Random(seed)
    parents = random_parents(rng, rng.randint(0, 12))
    mask, d = ancestor_mask(parents), depths(parents)
    for a in range(len(parents) + 1):
        ancestors = {0} | {1 + i for i in path_to(parents, a - 1)}  # row 0 is the root, row 1 + i node i
        assert {b for b in range(len(parents) + 1) if mask[a, b]} == ancestors
        assert d[a] == len(ancestors) - 1


def test_a_chain_has_the_causal_mask():
    assert torch.equal(ancestor_mask(TreeDraft.chain([5, 6, 7]).parents), torch.ones(4, 4, dtype=torch.bool).tril())
    assert depths(TreeDraft.chain([5, 6, 7]).parents) == [0, 1, 2, 3]


def test_deterministic_siblings_must_be_distinct():
    with pytest.raises(AssertionError, match="distinct"):
        TreeDraft((3, 3), (-1, -1))
    TreeDraft((3, 3), (-1, -1), probs=torch.full((2, 4), 0.25))  # sampled siblings may repeat


@pytest.mark.parametrize("seed", range(30))
def test_greedy_takes_the_longest_path_of_argmaxes(seed):
    rng = random.Random(seed)
    vocab = 3
    parents = random_parents(rng, rng.randint(0, 10))
    tree = TreeDraft(distinct_tokens(rng, parents, vocab), parents)
    logits = torch.randn(len(parents) + 1, vocab, generator=torch.Generator().manual_seed(seed))
    best = logits.argmax(-1).tolist()

    def follows_argmax(n):  # each node on the root path to n is the argmax of the row above it
        path = path_to(parents, n)
        rows = [0] + [c + 1 for c in path[:-1]]
        return all(tree.tokens[c] == best[r] for c, r in zip(path, rows))

    ok = [n for n in range(len(parents)) if follows_argmax(n)]  # they all lie on one path: take the deepest
    end = max(ok, key=lambda n: len(path_to(parents, n)), default=-1)
    want = [tree.tokens[c] for c in path_to(parents, end)] + [best[end + 1]]
    got = verify_tree_greedy(tree, logits)
    assert got.tokens == want and got.path == path_to(parents, end)


@pytest.mark.parametrize("seed", range(10))
def test_a_chain_tree_verifies_like_a_chain(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 6, generator=g)
    best = logits.argmax(-1).tolist()
    draft = best[:2] + [(best[2] + 1) % 6, best[3]]  # two accepted, then a miss
    chain = verify_greedy(torch.tensor(draft), logits)
    tree = verify_tree_greedy(TreeDraft.chain(draft), logits)
    assert (tree.accepted, tree.tokens) == (chain.accepted, chain.tokens) == (2, best[:3])


# ---- sampling: a Markov target P and drafter Q over V tokens, 3 output tokens per sample ----------------------------
V, LENGTH, SAMPLES = 4, 3, 20_000


def markov(seed: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(V, V, generator=g), -1)  # [V, V] rows: next-token distributions


P, Q = markov(0, 1.5), markov(1, 1.5)
Q_ROWS = Q.tolist()
TOP2 = [Q[t].topk(2).indices.tolist() for t in range(V)]


def grown_tree(last: int, g: torch.Generator) -> TreeDraft:
    """What a sampled EAGLE-3 / draft-model proposal is: Growth with children drawn from Q without replacement,
    the best newest node expanded, then the 3 best of the 8 candidate nodes by rank score. Its shape depends on the
    draws (a parent's token picks the grandchildren's Q row), so it tests the rank scoring as well as the rows."""
    tree = Growth(0, 1)
    tree.expand([-1], Q[last].log()[None], q=Q[last][None], sampler=DraftSampler(g))
    front = tree.frontier()
    rows = [tree.token[i] for i in front]
    tree.expand(front, Q[rows].log(), q=Q[rows], sampler=DraftSampler(g))
    return tree.best(3)


def build_tree(last: int, shape: str, rng: random.Random, g: torch.Generator | None = None) -> TreeDraft:
    """Depth-2 trees below `last`: `iid` (3 children each drawn from Q, 2 grandchildren below each), `topk` (Q's
    top-2 below the root and below each child, deterministic), `ragged` (iid, 2 children, only the first expanded),
    `grown` (`grown_tree`)."""
    if shape == "grown":
        return grown_tree(last, g)
    if shape == "topk":
        tokens, parents = list(TOP2[last]), [-1, -1]
        for i, t in enumerate(TOP2[last]):
            tokens += TOP2[t]
            parents += [i, i]
        return TreeDraft(tuple(tokens), tuple(parents))
    width, expand = (3, 3) if shape == "iid" else (2, 1)
    tokens = rng.choices(range(V), Q_ROWS[last], k=width)
    parents, rows = [-1] * width, [last] * width
    for i in range(expand):
        tokens += rng.choices(range(V), Q_ROWS[tokens[i]], k=2)
        parents += [i, i]
        rows += [tokens[i]] * 2
    return TreeDraft(tuple(tokens), tuple(parents), Q[rows])


def sample_counts(shape: str, samples: int = SAMPLES) -> tuple[torch.Tensor, float]:
    """Counts over the V**3 continuations of token 0, and the mean accepted nodes per verification."""
    rng, g = random.Random(1234), torch.Generator().manual_seed(1234)  # the drafter's and the verifier's randomness
    drafter_g = torch.Generator().manual_seed(99)
    counts = torch.zeros(V**LENGTH)
    accepted = steps = 0
    for _ in range(samples):
        out: list[int] = []
        while len(out) < LENGTH:
            last = out[-1] if out else 0
            tree = build_tree(last, shape, rng, drafter_g)
            p = P[[last] + list(tree.tokens)]  # [N + 1, V]: the Markov target's row after each query token
            verdict = verify_tree_sampled(tree, p, g)
            out += verdict.tokens
            accepted, steps = accepted + verdict.accepted, steps + 1
        x = out[:LENGTH]
        counts[(x[0] * V + x[1]) * V + x[2]] += 1
    return counts, accepted / steps


def exact() -> torch.Tensor:
    first = P[0]  # [V]
    return (first[:, None, None] * P[:, :, None] * P[None, :, :]).reshape(-1)  # P(x1) P(x2|x1) P(x3|x2)


@pytest.mark.parametrize("shape, samples", [("iid", SAMPLES), ("topk", 8_000), ("ragged", 8_000),
                                           ("grown", 8_000)])
def test_tree_sampling_matches_the_target_distribution(shape, samples):
    """Several i.i.d. siblings per node at 20,000 samples; the deterministic and the ragged shapes at fewer (CI time:
    still about 30 expected counts per cell)."""
    counts, accepted = sample_counts(shape, samples)
    assert 0.5 < accepted < 1.9, "the trees must be accepted sometimes and rejected sometimes for this to mean anything"
    pval = chi2_pvalue(counts, exact())
    assert pval > 1e-3, f"{shape} tree samples do not follow the target distribution (p = {pval:.2e})"


@pytest.mark.parametrize("shape", ["iid", "topk"])
def test_negative_control_without_the_residual_update_is_rejected(shape, monkeypatch):
    """Trying each sibling against the unchanged target distribution (no residual after a rejected sibling)
    over-weights the drafted tokens; the same test must see it, here with 2,000 samples (p ~ 1e-200 at 4,000)."""
    monkeypatch.setattr(tree_verify, "residual", lambda p, q, x: p)
    counts, _ = sample_counts(shape, 2_000)
    assert chi2_pvalue(counts, exact()) < 1e-3


def test_siblings_drawn_without_replacement_follow_the_closed_form():
    """The first two of draw_distinct's tokens against P(a, b) = q_a q_b / (1 - q_a), and the rows it returns are
    q without the earlier draws, renormalised."""
    q = torch.tensor([0.5, 0.25, 0.15, 0.1])
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(V * V)
    for _ in range(8_000):
        toks, rows = draw_distinct(q, 2, g)
        counts[toks[0] * V + toks[1]] += 1
    exact_pairs = (q[:, None] * q[None, :] / (1 - q[:, None])).fill_diagonal_(0.0).reshape(-1)
    assert chi2_pvalue(counts, exact_pairs) > 1e-3
    toks, rows = draw_distinct(q, 4, g)
    assert sorted(toks) == [0, 1, 2, 3] and rows.shape == (4, V)
    for j in range(4):
        want = q.clone()
        want[toks[:j]] = 0.0
        assert torch.allclose(rows[j], want / want.sum())
    assert draw_distinct(torch.tensor([0.0, 1.0, 0.0, 0.0]), 4, g)[0] == [1]  # no more tokens than q covers


def test_negative_control_grown_siblings_taken_as_iid_is_rejected(monkeypatch):
    """Without-replacement siblings verified as if each were drawn from the whole of Q (the rows left
    unrestricted): the later siblings are over-accepted, and the chi-square must see it."""
    def as_iid(q, m, generator, cdf=None):
        toks, rows = draw_distinct(q, m, generator, cdf)
        return toks, q.expand(len(toks), -1)

    monkeypatch.setattr(tree_growth, "draw_distinct", as_iid)
    counts, _ = sample_counts("grown", 8_000)
    assert chi2_pvalue(counts, exact()) < 1e-3


def test_negative_control_scoring_a_draw_by_its_own_probability_is_rejected(monkeypatch):
    """Scoring each drawn sibling by its own q (keeping the lucky draws) instead of by its rank: which siblings
    are verified then depends on what they drew, and the verified distribution moves."""
    real = Growth.expand

    def own_scores(self, parents, logp, to_ids=None, q=None, sampler=None):
        n = len(self.token)
        real(self, parents, logp, to_ids, q, sampler)
        for i in range(n, len(self.token)):
            base = 0.0 if self.parent[i] < 0 else self.score[self.parent[i]]
            self.score[i] = base + float(logp[parents.index(self.parent[i]), self.token[i]])

    monkeypatch.setattr(Growth, "expand", own_scores)
    counts, _ = sample_counts("grown", 2_000)  # p ~ 1e-231 at 4,000
    assert chi2_pvalue(counts, exact()) < 1e-3
