"""Draft trees through the whole engine: n-gram trees verified in the batched forward, several requests at once,
greedy output equal to HF transformers' greedy decoding, the state oracle checking the KV cache after every step;
seeded sampling runs and emits logprobs from the rows its tokens came from."""

from __future__ import annotations

import pytest

from tests.helpers import hf_greedy
from verispec import LLM, SamplingParams
from verispec.config import SpeculativeConfig
from verispec.drafters.base import Draft
from verispec.drafters.ngram import NgramDrafter
from verispec.models.tree import TreeDraft

# prompts that repeat with variations, so that the tail has several earlier continuations (a branching tree)
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 11, 5, 6],
    [20, 21, 22, 20, 21, 23, 20, 21, 22, 24, 20, 21],
    [30, 31, 30, 32, 30, 31, 33, 30],
    [40, 41, 42, 43, 44, 40, 41, 42, 45, 40, 41],
]


def forced_trees(monkeypatch, futures: dict[tuple[int, ...], list[int]]):
    """The n-gram drafter's trees replaced by branching ones built from each prompt's known greedy future: at every
    depth a wrong sibling first, then the right token (the path goes on below it), and at depth 3 only a wrong one.
    So every step verifies a branching tree, accepts along second children, and rejects in the middle."""
    seen = {"trees": 0}

    def propose_tree(self, context, budget, depth):
        prompt = next(p for p in futures if tuple(context[: len(p)]) == p)
        future = futures[prompt][len(context) - len(prompt):]
        tokens, parents, at = [], [], -1
        for d in range(min(depth, len(future), 4)):
            tokens.append((future[d] + 1 + d) % 97)
            parents.append(at)
            if d == 3:
                break
            tokens.append(future[d])
            parents.append(at)
            at = len(tokens) - 1
        seen["trees"] += 1
        return TreeDraft(tuple(tokens[:budget]), tuple(parents[:budget]))

    monkeypatch.setattr(NgramDrafter, "propose_tree", propose_tree)
    return seen


def _llm(tiny_dir, method="ngram", **kw):
    spec = {"method": method, "num_speculative_tokens": 6, "draft_tree": True, "adaptive": False}  # trees whole
    if method == "ngram":
        spec["prompt_lookup_max"] = 2
    return LLM(str(tiny_dir), dtype="float32", device="cpu", speculative_config=spec, max_num_seqs=4,
               check_state=True, **kw)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_tree_greedy_output_equals_hf_and_the_state_holds(tiny_dir, hf, method):
    llm = _llm(tiny_dir, method)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert list(o.token_ids) == hf_greedy(hf, p, 24)
    assert sum(o.stats["num_draft_tokens"] for o in outs) > 0


def test_branching_trees_greedy_output_equals_hf_and_the_state_holds(tiny_dir, hf, monkeypatch):
    futures = {tuple(p): hf_greedy(hf, p, 32) for p in PROMPTS}
    seen = forced_trees(monkeypatch, futures)
    llm = _llm(tiny_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert list(o.token_ids) == futures[tuple(p)][:24]
        # each branching tree accepts 3 nodes along second children (fewer where max_tokens cuts it): tau near 4
        assert o.stats["num_accepted_tokens"] >= 3 * (o.stats["steps"] - 2)
    assert seen["trees"] > 0


def test_tree_sampling_runs_with_logprobs(tiny_dir, hf, monkeypatch):
    seen = forced_trees(monkeypatch, {tuple(p): hf_greedy(hf, p, 32) for p in PROMPTS})
    llm = _llm(tiny_dir)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=3, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]  # seeded: reproducible
    for o in outs:
        assert len(o.token_ids) == 16 and len(o.logprobs) == 16
        assert all(tid in lp for tid, lp in zip(o.token_ids, o.logprobs))
    assert seen["trees"] > 0


def test_trees_are_refused_where_they_do_not_exist_yet():
    with pytest.raises(ValueError, match="draft_tree"):
        SpeculativeConfig(method="mtp", model="x", draft_tree=True)
    with pytest.raises(ValueError, match="draft_tree"):
        SpeculativeConfig(method="ngram", draft_tree=True, acceptance_rule="threshold", threshold_single=0.5)
    with pytest.raises(ValueError, match="draft_tree takes"):
        SpeculativeConfig(method="ngram", draft_tree="sometimes")


@pytest.mark.parametrize("good", ["tree", "chain"])
def test_auto_shape_drafts_the_shape_that_commits_more(tiny_dir, hf, monkeypatch, good):
    """"draft_tree": "auto": one shape drafts the known future (all accepted), the other only wrong tokens (none
    accepted). The engine must settle on the good shape, retry the other every 8th step, and stay exact."""
    futures = {tuple(p): hf_greedy(hf, p, 40) for p in PROMPTS}
    calls = {"tree": 0, "chain": 0}

    def future_of(context):
        prompt = next(p for p in futures if tuple(context[: len(p)]) == p)
        return futures[prompt][len(context) - len(prompt):]

    def propose_tree(self, context, budget, depth):
        calls["tree"] += 1
        f = future_of(context)[: min(budget, depth)]
        toks = f if good == "tree" else [(t + 1) % 97 for t in f]
        return TreeDraft(tuple(toks), tuple(range(-1, len(toks) - 1)))

    def propose(self, context, k):
        calls["chain"] += 1
        f = future_of(context)[:k]
        return Draft(f if good == "chain" else [(t + 1) % 97 for t in f])

    monkeypatch.setattr(NgramDrafter, "propose_tree", propose_tree)
    monkeypatch.setattr(NgramDrafter, "propose", propose)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "draft_tree": "auto", "adaptive": False}
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", speculative_config=spec, max_num_seqs=4,
              check_state=True, scheduler="static")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=36, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert list(o.token_ids) == futures[tuple(p)][:36]
    bad = "chain" if good == "tree" else "tree"
    assert calls[good] >= 3 * calls[bad] > 0, calls


def test_prefer_tree_is_committed_tokens_per_second():
    """Closed form: (1 + sum of the i.i.d. survivals a^j, j = 1..n) / (step with n rows + n x drafting cost per
    token), with n = k for the tree and the chain's own length for the chain."""
    from verispec.engine.acceptance import AcceptanceEstimator, prefer_tree

    def est(a, cost):
        e = AcceptanceEstimator(prior=a)
        e.draft_cost_per_token = cost
        return e

    def rate(a, cost, k=4, step=0.010, per_row=0.0):
        return (1 + sum(a ** j for j in range(1, k + 1))) / (step + k * per_row + k * cost)

    def flat(step):
        return lambda n: step

    chain, cheap_tree, dear_tree = est(0.5, 0.001), est(0.7, 0.001), est(0.7, 0.004)
    assert rate(0.7, 0.001) > rate(0.5, 0.001) and prefer_tree(chain, cheap_tree, 4, flat(0.010))
    assert rate(0.7, 0.004) < rate(0.5, 0.001) and not prefer_tree(chain, dear_tree, 4, flat(0.010))
    assert rate(0.7, 0.004, step=0.100) > rate(0.5, 0.001, step=0.100) and prefer_tree(chain, dear_tree, 4, flat(0.100))
    assert not prefer_tree(chain, est(0.5, 0.001), 4, flat(0.010))  # a tie keeps the chain
    # rows that cost (1.2 ms each on a 4 ms step): a chain that stops itself after one token verifies one row. The
    # tree's 4 rows commit more tokens per second than the chain would at 4, but fewer than the chain's one
    chain, tree = est(0.65, 0.0003), est(0.7, 0.0003)
    rows = lambda n: 0.004 + 0.0012 * n  # noqa: E731
    assert rate(0.7, 0.0003, step=0.004, per_row=0.0012) > rate(0.65, 0.0003, step=0.004, per_row=0.0012)
    assert prefer_tree(chain, tree, 4, rows)
    assert rate(0.65, 0.0003, k=1, step=0.004, per_row=0.0012) > rate(0.7, 0.0003, step=0.004, per_row=0.0012)
    assert not prefer_tree(chain, tree, 4, rows, chain_len=1)
    assert prefer_tree(chain, tree, 4, rows, chain_len=9) == prefer_tree(chain, tree, 4, rows)  # at most k rows


def test_auto_prices_a_chain_at_its_measured_proposal_length():
    """`LiveRequest.choose_shape` takes the chain's length from the lengths its proposals measured: after chain
    proposals of one token (a drafter that stops itself) the chain is priced at one row, and auto keeps it where
    pricing it at k rows would have sent the request to trees."""
    from verispec.engine.acceptance import AcceptanceEstimator
    from verispec.engine.plan import LiveRequest
    from verispec.sampling import SamplingParams
    from verispec.state.request import Request

    rows = lambda n: 0.004 + 0.0012 * n  # noqa: E731
    picks = {}
    for length in (1, 4):
        lv = LiveRequest(Request([1, 2, 3], SamplingParams(temperature=0)), object(),
                         AcceptanceEstimator(prior=0.65), None, None)
        lv.tree_estimator = AcceptanceEstimator(prior=0.7)
        for _ in range(3):  # the first proposal catches up and is not timed
            lv.estimator.observe_draft(length, 0.0003 * length)
            lv.tree_estimator.observe_draft(4, 0.0012)
        lv.choose_shape(4, rows)
        picks[length] = lv.tree_now
    assert picks == {1: False, 4: True}
def test_auto_compares_what_each_shape_did_once_both_are_measured():
    """After SHAPE_MEASURED steps of each shape, "auto" goes by what they did, whatever the estimates say: tokens
    per step over the step's time at the measured rows (interpolated between whole rows) plus the drafting time per
    step, all EMAs (closed form below); a step whose draft was cut to nothing counts (one token, no rows, its
    drafting time). Before that, the estimates decide."""
    from verispec.engine.acceptance import SHAPE_MEASURED, AcceptanceEstimator, ShapeRecord, prefer_tree

    rows = lambda n: 0.004 + 0.0012 * n  # noqa: E731
    chain, tree = AcceptanceEstimator(prior=0.5), AcceptanceEstimator(prior=0.8)  # the estimates favour the tree
    assert prefer_tree(chain, tree, 4, rows)
    done_chain, done_tree = ShapeRecord(), ShapeRecord()
    for _ in range(SHAPE_MEASURED):
        done_chain.observe(1, 1, 0.0008)  # one row, accepted: 2 tokens a step
        done_tree.observe(4, 1, 0.0012)  # four rows, a path of 1: 2 tokens a step
    assert (done_chain.tokens, done_tree.rows, done_tree.draft_s) == (2.0, 4.0, pytest.approx(0.0012))
    assert done_chain.rate(rows) == pytest.approx(2 / (rows(1) + 0.0008))
    assert done_chain.rate(rows) > done_tree.rate(rows)
    assert not prefer_tree(chain, tree, 4, rows, measured=(done_chain, done_tree))
    for _ in range(3):  # three steps of five tokens: the EMA (weight 0.25) goes 2 -> 5 - 3 x 0.75^3
        done_tree.observe(4, 4, 0.0012)
    assert done_tree.tokens == pytest.approx(5 - 3 * 0.75**3)
    assert done_tree.tokens / (rows(4) + 0.0012) > 2 / (rows(1) + 0.0008)
    assert prefer_tree(chain, tree, 4, rows, measured=(done_chain, done_tree))
    for _ in range(6):  # the trees' drafts now cut to nothing on most steps: 1 token, no rows, drafting spent
        done_tree.observe(0, 0, 0.0012)
    r, t = done_tree.rows, done_tree.tokens
    want = t / (rows(0) + r * (rows(1) - rows(0)) + 0.0012)  # 0 < rows < 1: interpolated
    assert 0 < r < 1 and done_tree.rate(rows) == pytest.approx(want)
    assert done_tree.rate(rows) < done_chain.rate(rows)
    assert not prefer_tree(chain, tree, 4, rows, measured=(done_chain, done_tree))
    fresh = ShapeRecord()
    fresh.observe(1, 1, 0.0008)
    assert prefer_tree(chain, tree, 4, rows, measured=(fresh, done_tree))  # one shape under-measured: estimates


def test_a_tree_step_leaves_what_the_chains_say_of_their_confidences():
    """Trees carry no confidences; with "auto" a tree step must not make the next chain step look like one from a
    drafter without them (the policy would then drop the chain's early stop and verify-time admission). A chain
    that comes without confidences still says so."""
    from verispec.drafters.base import Draft
    from verispec.engine.acceptance import AcceptanceEstimator
    from verispec.engine.plan import LiveRequest
    from verispec.models.tree import TreeDraft
    from verispec.state.request import Request

    class Drafter:
        confident = True

        def propose(self, context, k):
            return Draft([5] * k, confidence=[0.9] * k if self.confident else None)

        def propose_tree(self, context, budget, depth):
            return TreeDraft(tuple([5] * budget), tuple([-1] + list(range(budget - 1))))

    d = Drafter()
    lv = LiveRequest(Request([1, 2, 3], SamplingParams(temperature=0)), d, AcceptanceEstimator(), None, None)
    assert lv.propose(3).confidence == [0.9] * 3 and lv.confidences
    lv.tree_now = True
    assert lv.propose(3).parents is not None and lv.confidences
    lv.tree_now, d.confident = False, False
    assert lv.propose(3).confidence is None and not lv.confidences


def test_the_tree_estimate_starts_from_the_drafting_time_chains_measured():
    """"draft_tree": "auto" keeps a second estimate for trees. It starts from what the request's chain proposals
    measured, not from an unknown time priced as free: a drafter dear against the step (4 ms a token, 10 ms steps)
    is not sent to trees on its first choice by a price of zero (at equal acceptance a tie keeps the chain)."""
    from verispec import SamplingParams
    from verispec.engine.acceptance import AcceptanceEstimator
    from verispec.engine.plan import LiveRequest
    from verispec.state.request import Request

    chain = AcceptanceEstimator()
    chain.observe_draft(4, 0.5)  # catching up on the prompt: not the rate
    for _ in range(5):
        chain.observe_draft(4, 0.016)
    lv = LiveRequest(Request([1, 2, 3], SamplingParams(temperature=0, max_tokens=8)), None, chain, None, None)
    lv.choose_shape(4, lambda n: 0.010)
    assert lv.tree_estimator is not None and lv.tree_estimator is not chain
    assert lv.tree_estimator.draft_cost(4) == pytest.approx(chain.draft_cost(4)) == pytest.approx(0.016)
    assert lv.tree_now is False
