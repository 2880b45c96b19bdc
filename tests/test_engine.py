"""The continuous-batching engine: at fp32 and greedy every request's output equals HF transformers' greedy
output for it alone, whatever the concurrency, drafter or policy; requests join, wait, leave and abort cleanly."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from tests.helpers import best_paths, eagle2_scores, hf_greedy
from verispec import LLM, SamplingParams
from verispec.engine.core import RequestTooLong
from verispec.state.request import Request

PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3],
    [7, 7, 7, 7],
    [10, 20, 30, 10, 20, 30, 10],
    list(range(40, 50)),
    [3],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 5, 6, 7],  # longer than a prefill chunk
]
MAX_TOKENS = [30, 12, 25, 7, 20, 16]  # requests leave at different steps


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    common = dict(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    out = {}
    for name, cfg in {"llama": LlamaConfig(**common), "mistral-window": MistralConfig(**common, sliding_window=6)}.items():
        torch.manual_seed(7 + len(name))
        m = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            m.lm_head.weight.mul_(4.0)  # sharper distributions: repeated runs for the drafters to find
        d = tmp_path_factory.mktemp(name)
        m.save_pretrained(d)
        out[name] = (str(d), m)
    torch.manual_seed(3)
    draft = tmp_path_factory.mktemp("draft")
    AutoModelForCausalLM.from_config(LlamaConfig(**{**common, "num_hidden_layers": 1})).save_pretrained(draft)
    out["draft"] = (str(draft), None)
    return out


@pytest.fixture(scope="module")
def references(tiny):
    return {arch: [hf_greedy(tiny[arch][1], p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
            for arch in ("llama", "mistral-window")}


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


@pytest.mark.parametrize("arch", ["llama", "mistral-window"])
@pytest.mark.parametrize("method", ["none", "ngram", "suffix", "draft_model"])
@pytest.mark.parametrize("scheduler", ["static", "goodput", "dspark"])
def test_batched_output_equals_hf_single_stream(tiny, references, arch, method, scheduler):
    spec = None if method == "none" else {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        spec["model"] = tiny["draft"][0]
    # 6 requests, 4 slots: two wait for a slot; 8-token batches force chunked prefill of the long prompts
    llm = LLM(tiny[arch][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4,
              speculative_config=spec, scheduler=scheduler, check_state=True, max_num_batched_tokens=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    for i, (o, ref) in enumerate(zip(outs, references[arch])):
        assert o.token_ids == ref, f"request {i} ({method}, {scheduler}, {arch}) differs from HF's single-stream output"
    assert llm.engine.kv_tokens() == 0 and not llm.engine.running
    assert all(not s.in_use for s in llm.cache.slots), "a finished request kept its cache slot"


def test_dspark_never_drafts_where_no_draft_could_pay(tiny, references, monkeypatch):
    """A saturated batch (every draft token costs a whole step, so no draft could pay even if sure to survive):
    dspark drafts nothing, for n-gram drafts stripped of their confidences and with them, and the output is HF's."""
    from verispec.drafters.base import Draft
    from verispec.drafters.ngram import NgramDrafter
    from verispec.engine.costs import CostTable, StepCosts

    propose = NgramDrafter.propose
    for confident in (False, True):
        asked = []
        if confident:
            monkeypatch.setattr(NgramDrafter, "propose", lambda self, ctx, k: asked.append(k) or propose(self, ctx, k))
        else:
            monkeypatch.setattr(NgramDrafter, "gives_confidence", False)
            monkeypatch.setattr(NgramDrafter, "propose",
                                lambda self, ctx, k: asked.append(k) or Draft(propose(self, ctx, k).tokens))
        llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4}, scheduler="dspark")
        # linear: one more row costs one more step (as profiled and kept, not corrected by the tiny model's forwards)
        llm.engine.policy.costs = StepCosts(CostTable((1, 64), (1.0, 64.0)))
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
        assert [o.token_ids for o in outs] == references["llama"]
        assert asked == [], f"n-gram drafts asked for where none could be verified (confidences: {confident}): {asked}"
        assert all(o.stats["num_draft_tokens"] == 0 for o in outs)
        monkeypatch.undo()


@pytest.mark.parametrize("scheduler", ["static", "dspark"])
def test_the_suffix_cache_gets_every_finished_request_s_whole_output(tiny, references, scheduler):
    """A finished request hands its whole output to the shared suffix cache: with a draft every step (the last
    step's accepted tokens and bonus come after the last proposal) and with none at all (a saturated batch, where
    dspark never calls the drafter)."""
    from verispec.engine.costs import CostTable, StepCosts

    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4}, scheduler=scheduler)
    if scheduler == "dspark":
        llm.engine.policy.costs = StepCosts(CostTable((1, 64), (1.0, 64.0)))  # no draft could pay
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    assert [o.token_ids for o in outs] == references["llama"]
    assert sorted(llm.drafters.suffix_cache._outputs) == sorted(references["llama"])
    drafted = sum(o.stats["num_draft_tokens"] for o in outs)
    assert (drafted == 0) == (scheduler == "dspark"), f"{drafted} draft tokens under {scheduler}"


def _right_tokens(references):
    """A proposal of the next k tokens each prompt's greedy output will have (the drafter is never wrong)."""
    full = {tuple(p): p + r for p, r in zip(PROMPTS, references["llama"])}

    def right(ctx, k):
        whole = next(w for p, w in full.items() if tuple(ctx[: len(p)]) == p)
        return list(whole[len(ctx) : len(ctx) + k])
    return right


def _goodput_on_5ms_steps(tiny) -> LLM:
    """One request at a time under goodput, its cost table 5 ms a forward however many tokens: a draft pays where
    drafting it is cheap (tens of microseconds here, with room for a slow call on a busy machine)."""
    from verispec.engine.costs import CostTable, StepCosts

    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4}, scheduler="goodput")
    llm.engine.policy.costs = StepCosts(CostTable((1, 64), (5e-3, 5e-3)))
    return llm


@contextlib.contextmanager
def _no_gc():
    """No garbage collection inside: these tests time the drafter, and a collection late in a long test session
    can take longer than the drafting costs they tell apart."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _drafter_calls_per_request(tiny, references, monkeypatch, pause) -> list[int]:
    """The prompts with 12 or more reference tokens, one request after the other, drafted by a drafter that
    proposes the right tokens after sleeping pause(its call in this request, its call overall) seconds; every
    output checked. Returns how many times each request called its drafter."""
    import time

    from verispec.drafters.base import Draft
    from verispec.drafters.ngram import NgramDrafter

    right, counts, total = _right_tokens(references), [], [0]

    def propose(self, ctx, k):
        counts[-1] += 1
        total[0] += 1
        time.sleep(pause(counts[-1], total[0]))
        return Draft(right(ctx, k))

    monkeypatch.setattr(NgramDrafter, "propose", propose)
    llm = _goodput_on_5ms_steps(tiny)
    with _no_gc():
        for p, want in zip(PROMPTS, references["llama"]):
            if len(want) >= 12:
                counts.append(0)
                out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=len(want),
                                                                             ignore_eos=True), use_tqdm=False)[0]
                assert out.token_ids == want
    return counts


def test_a_new_request_starts_from_the_drafting_cost_earlier_requests_measured(tiny, references, monkeypatch):
    """A drafter far dearer than a step (20 ms per drafted token against 5 ms forwards): the first
    request learns that from its second proposal (its first is not the rate: see below), and the requests after it
    start from the measured cost, so they never draft (before, a new request's unknown cost was free: each drafted
    the whole limit once)."""
    import time

    from verispec.drafters.base import Draft
    from verispec.drafters.ngram import NgramDrafter

    calls, right = [], _right_tokens(references)

    def dear(self, ctx, k):
        calls.append(len(ctx))
        time.sleep(0.02 * k)
        return Draft(right(ctx, k))

    monkeypatch.setattr(NgramDrafter, "propose", dear)
    llm = _goodput_on_5ms_steps(tiny)
    with _no_gc():
        for p in PROMPTS[:3]:  # one after the other
            llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    n = len(PROMPTS[0])
    assert len(calls) == 2 and calls[0] == n + 1 and n + 1 < calls[1] <= n + 12, calls


def test_a_request_s_first_proposal_is_not_taken_as_its_drafter_s_rate(tiny, references, monkeypatch):
    """A drafter that proposes the right tokens, dear on its first call per request (40 ms: catching up on the
    prompt, as a suffix trie or a draft model's context does) and cheap after: every request goes on drafting after
    its first proposal. Before, that first call's time was the estimate, so the first request stopped drafting
    there and every later one, seeded with it, never drafted at all (suffix on json_records fell to tau 1.0 so)."""
    counts = _drafter_calls_per_request(tiny, references, monkeypatch, lambda own, _: 0.04 if own == 1 else 0.0)
    assert all(c > 1 for c in counts), counts


def test_one_pause_in_a_proposal_does_not_price_drafting_out_for_the_engine(tiny, references, monkeypatch):
    """A cheap drafter that proposes the right tokens, one of whose calls is caught by a 300 ms pause (a garbage
    collection, the machine busy): every request, the first included, keeps drafting. Before, that one time
    averaged in made drafting dearer than any step and put the next probe thousands of steps away, and every
    later request, seeded with it, never drafted."""
    # the first request's third proposal: its second timed one
    counts = _drafter_calls_per_request(tiny, references, monkeypatch, lambda _, call: 0.3 if call == 3 else 0.0)
    assert all(c > 1 for c in counts), counts


def test_a_stale_dear_estimate_lets_the_drafter_be_timed_again(tiny, references, monkeypatch):
    """The engine starts from an estimate far dearer than the drafter now is (measured on a busy machine: 80 ms a
    proposal against 5 ms steps), so nothing is drafted; each request that measured nothing leaves it a fifth
    lower, until a probe or a draft times the drafter again (about 10 us), and from then on it drafts. Before, a
    stale estimate stood for good."""
    from verispec.drafters.base import Draft
    from verispec.drafters.ngram import NgramDrafter
    from verispec.engine.draft_timing import DraftTiming

    right, drafted = _right_tokens(references), []
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, ctx, k: Draft(right(ctx, k)))
    llm = _goodput_on_5ms_steps(tiny)
    llm.engine._draft_timing = DraftTiming(per_token=0.02, per_proposal=0.08)
    p, want = PROMPTS[0], references["llama"][0]
    with _no_gc():
        for _ in range(40):
            out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=len(want),
                                                                         ignore_eos=True), use_tqdm=False)[0]
            assert out.token_ids == want
            drafted.append(out.stats["num_draft_tokens"])
    assert drafted[0] == 0, drafted  # the stale estimate held it off at first
    assert drafted[-1] > len(want) // 2 and llm.engine._draft_timing.per_proposal < 1e-3, drafted


def test_drafts_the_policy_never_verifies_still_teach_the_estimate(tiny, references, monkeypatch):
    """A drafter whose proposals the policy cuts to nothing every step (as DSpark's own low confidences do) and
    whose first token is never the target's: the estimate learns that from the committed tokens, so the drafter
    stops being run every step (it was, on the prior estimate, with nothing ever verified to correct it)."""
    from verispec.drafters.base import Draft
    from verispec.drafters.ngram import NgramDrafter
    from verispec.engine.costs import CostTable, StepCosts
    from verispec.engine.scheduler import DSparkPolicy

    calls = []
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, ctx, k: calls.append(k) or Draft([59] * k))
    monkeypatch.setattr(DSparkPolicy, "verify_lengths", lambda self, cands, drafts, base: [0] * len(drafts))
    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4}, scheduler="dspark")
    llm._costs = StepCosts(CostTable((1, 64), (1.0, 1.0 + 0.2 * 63)))  # a draft row costs a fifth of a step
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    assert [o.token_ids for o in outs] == references["llama"]
    decode_steps = sum(len(o.token_ids) - 1 for o in outs)
    assert 59 not in {t for o in outs for t in o.token_ids}, "the test's wrong token was right: pick another"
    assert 0 < len(calls) <= 0.4 * decode_steps, f"{len(calls)} drafter runs over {decode_steps} decode steps"


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_trees_on_a_sliding_window_model_equal_hf_and_the_state_holds(tiny, references, method, block_size):
    """Draft trees on a Mistral with a window of 6 (trees up to 4 deep), chunked prefill, 6 requests in 4 slots,
    with KV blocks of 16 and of 4 positions (trees across block edges): greedy output equals HF's, state oracle on."""
    spec = {"method": method, "num_speculative_tokens": 4, "draft_tree": True, "adaptive": False}
    llm = LLM(tiny["mistral-window"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4,
              speculative_config=spec, check_state=True, max_num_batched_tokens=8, block_size=block_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    assert [o.token_ids for o in outs] == references["mistral-window"]
    assert sum(o.stats["num_accepted_tokens"] for o in outs) > 0  # the trees were verified and some accepted


def test_trees_deeper_than_a_sliding_window_are_refused_up_front(tiny):
    """A tree as deep as the window would put an ancestor out of a row's window: refused when the engine is built,
    for the target and for a draft model, instead of failing a step."""
    spec = {"method": "ngram", "num_speculative_tokens": 6, "draft_tree": True}
    with pytest.raises(ValueError, match="the target's sliding window of 6 positions"):
        LLM(tiny["mistral-window"][0], dtype="float32", device="cpu", max_model_len=64, speculative_config=spec)
    spec = {"method": "draft_model", "model": tiny["mistral-window"][0], "num_speculative_tokens": 6,
            "draft_tree": True}
    with pytest.raises(ValueError, match="the draft model's sliding window of 6 positions"):
        LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, speculative_config=spec)
    LLM(tiny["mistral-window"][0], dtype="float32", device="cpu", max_model_len=64,  # 5 levels fit a window of 6
        speculative_config={"method": "ngram", "num_speculative_tokens": 5, "draft_tree": True})


@pytest.mark.parametrize("width", [1, 4])
def test_draft_model_tree_is_eagle2_selection_over_hf_scored_paths(tiny, tmp_path, width):
    """The draft model's tree (one tree-masked draft forward per depth) against EAGLE-2's selection simulated here,
    every path's log-probability from HF's draft model run on context + path from scratch; `width` nodes expanded
    per depth (1: one chain, 4: several branches, each seeing only its own ancestors)."""
    from transformers import AutoModelForCausalLM

    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.drafters.tree_growth import TREE_TOPK, frontier_width
    from verispec.models.loader import load_model, resolve

    hf = AutoModelForCausalLM.from_pretrained(tiny["draft"][0], dtype=torch.float32).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # spread the scores: no near-ties between candidate paths
    hf.save_pretrained(tmp_path)
    model, _ = load_model(resolve(str(tmp_path), progress=False), dtype="float32", device="cpu", progress=False)
    ctx, budget, depth = PROMPTS[0][:9], 7, 4

    def logp(path: tuple[int, ...]) -> torch.Tensor:  # [V]
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ctx + list(path)])).logits[0, -1].float(), -1)

    scores = eagle2_scores(logp, depth, TREE_TOPK, width)
    want = best_paths(scores, budget)

    d = DraftModelDrafter(model, model.new_cache(32), SamplingParams(temperature=0))
    d.propose(ctx[:5], 2)  # a chain first, all rejected: the tree starts from a cache holding ctx[:5]
    d.observe(0)
    grown = d._grow(ctx, budget, depth, width)  # every candidate, with the score the drafter gave it
    got = {}
    for i in range(len(grown.token)):
        got[tuple(grown.token[j] for j in reversed(grown.path(i)))] = grown.score[i]
    assert set(got) == set(scores)
    for q, score in got.items():
        assert abs(score - scores[q]) < 1e-4, q
    d.check_own_state(ctx)
    tree = d.propose_tree(ctx, budget, depth, None if width == frontier_width(budget) else width)

    def path_of(i: int) -> tuple[int, ...]:
        out = []
        while i >= 0:
            out.append(tree.tokens[i])
            i = tree.parents[i]
        return tuple(reversed(out))

    assert {path_of(i) for i in range(len(tree))} == want and len(tree) == budget
    assert max(map(len, want)) > 1 and len({q[0] for q in want}) > 1  # a real tree: deep and branching
    d.check_own_state(ctx)  # nothing drafted stayed in the draft cache


def test_draft_model_confidences_are_hf_probabilities_and_min_survival_cuts_the_chain(tiny):
    """A draft-model chain's confidences are HF's draft model probabilities of the drafted tokens (greedy: its
    top-1 after context + the tokens before); with min_survival s the chain stops after the first token at which
    their running product falls below s, and after the verdict the draft cache holds exactly the accepted prefix."""
    from transformers import AutoModelForCausalLM

    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.models.loader import load_model, resolve

    hf = AutoModelForCausalLM.from_pretrained(tiny["draft"][0], dtype=torch.float32).eval()
    model, _ = load_model(resolve(tiny["draft"][0], progress=False), dtype="float32", device="cpu", progress=False)
    ctx = PROMPTS[0][:9]
    full = DraftModelDrafter(model, model.new_cache(32), SamplingParams(temperature=0)).propose(ctx, 5)
    with torch.no_grad():
        for i, t in enumerate(full.tokens):
            p = torch.softmax(hf(torch.tensor([ctx + full.tokens[:i]])).logits[0, -1].float(), -1)
            assert t == int(p.argmax()) and full.confidence[i] == pytest.approx(float(p.max()), rel=1e-4)
    surv = torch.tensor(full.confidence).cumprod(0).tolist()
    for s in ((surv[1] + surv[2]) / 2, 1.01):
        d = DraftModelDrafter(model, model.new_cache(32), SamplingParams(temperature=0))
        cut = d.propose(ctx, 5, min_survival=s)
        n = next(i + 1 for i, v in enumerate(surv) if v < s)
        assert cut.tokens == full.tokens[:n]
        d.observe(n)  # all accepted: the cache keeps the fed drafts (the last one drafted was never fed)
        d.check_own_state(ctx + cut.tokens)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_model_trees_in_the_engine(tiny, references, temperature):
    """Draft-model trees through the engine, state oracle on: greedy equals HF; sampled runs reproducibly."""
    spec = {"method": "draft_model", "model": tiny["draft"][0], "num_speculative_tokens": 5, "draft_tree": True,
            "adaptive": False}
    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4,
              speculative_config=spec, check_state=True, max_num_batched_tokens=8, scheduler="static")
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate(MAX_TOKENS)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert sum(o.stats["num_draft_tokens"] for o in outs) > 0
    if temperature == 0:
        assert [o.token_ids for o in outs] == references["llama"]
    else:
        again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in again]


def test_requests_join_while_others_decode(tiny, references):
    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=3,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, scheduler="dspark")
    eng = llm.engine
    reqs = [Request(p, prm) for p, prm in zip(PROMPTS, _params())]
    pending = list(reqs)
    steps = 0
    while pending or eng.has_work():
        if pending and steps % 3 == 0:  # a new request every third step
            eng.add_request(pending.pop(0))
        eng.step()
        steps += 1
    for r, ref in zip(reqs, references["llama"]):
        assert r.output_ids == ref
    assert eng.num_finished == len(PROMPTS)


class FailingDrafter:
    """Wraps a request's drafter; its third proposal raises, as a buggy or out-of-memory drafter would."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.calls, self.released = inner, inner.name, 0, False

    def propose(self, context, k):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("drafter out of memory")
        return self.inner.propose(context, k)

    def observe(self, accepted: int) -> None:
        self.inner.observe(accepted)

    def release(self, tokens=None) -> None:
        self.released = True
        self.inner.release(tokens)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_failing_drafter_hurts_only_its_request(tiny, references, method):
    """The request whose drafter raises decodes on without speculation (the target's output either way); the drafter
    is released at once and the error is in its stats; every other request speculates on, all equal HF greedy."""
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "draft_model":
        spec["model"] = tiny["draft"][0]
    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4,
              speculative_config=spec, check_state=True)
    made, new = [], llm.drafters.new

    def new_drafter(params, prompt_len):
        d = new(params, prompt_len)
        if prompt_len == len(PROMPTS[0]):
            made.append(FailingDrafter(d))
            return made[-1]
        return d

    llm.drafters.new = new_drafter
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    assert [o.token_ids for o in outs] == references["llama"]
    assert len(made) == 1 and made[0].calls == 3 and made[0].released
    assert outs[0].stats["drafter_error"] == "RuntimeError: drafter out of memory"
    assert all(o.stats["drafter_error"] is None for o in outs[1:])
    assert sum(o.stats["num_draft_tokens"] for o in outs[1:]) > 0  # the others kept speculating
    assert llm.engine.kv_tokens() == 0 and not llm.engine.running


def test_engine_reports_every_forward_to_the_policy(tiny):
    """What the cost model learns from: each decode forward's tokens and sequences, counted independently from the
    stats (the last prompt token's forward, then per decode step the pending token plus the verified draft); the
    prompt's prefill forward is not what the policies ask about and is left out."""
    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    seen = []
    llm.engine.policy.observe_step = lambda tokens, segments, seconds: seen.append((tokens, segments, seconds))
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    # the last prompt token, sampling the first output token; then the decode steps
    assert seen[0][0] == 1 and all(s == 1 and sec > 0 for _, s, sec in seen)
    assert len(seen) == 1 + out.stats["steps"] and out.stats["num_draft_tokens"] > 0
    assert sum(t for t, _, _ in seen[1:]) == out.stats["steps"] + out.stats["num_draft_tokens"]


def test_step_clock_counts_every_forward_and_splits_each_step_by_phase(tiny):
    """What /metrics publishes as verispec:engine_step* (engine/counters.py), against the forwards counted and
    timed from outside the engine: one step per forward, the rows fed to them, forward seconds equal to the
    runner's, drafting equal to the drafters' own time, and the phases adding up to the step's wall time."""
    import time

    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=3,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    eng = llm.engine
    forwards, walls, run, step = [], [], eng.runner.run, eng.step

    def timed_run(blocks, recorded):
        t = time.perf_counter()
        out = run(blocks, recorded)
        forwards.append((sum(len(b.tokens) for b in blocks), time.perf_counter() - t))
        return out

    def timed_step():
        t = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t)

    new_drafter = eng.drafters.new

    def slow_drafter(*a, **kw):  # drafting that takes a visible share of the step
        d = new_drafter(*a, **kw)
        propose = d.propose
        d.propose = lambda *pa, **pk: (time.sleep(0.003), propose(*pa, **pk))[1]
        return d

    eng.runner.run, eng.step, eng.drafters.new = timed_run, timed_step, slow_drafter
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], _params()[:4], use_tqdm=False)
    c = eng.clock
    assert c.steps == len(forwards) > 0 and c.forward_tokens == sum(n for n, _ in forwards)
    assert c.forward_tokens == sum(len(p) for p in PROMPTS[:4]) + sum(
        o.stats["steps"] + o.stats["num_draft_tokens"] for o in outs)  # prompts, then each step's pending + drafts
    assert c.seconds["forward"] == pytest.approx(sum(s for _, s in forwards), rel=0.05, abs=1e-3)
    # each request's stats round draft_s to 6 decimals (state/request.py): the sum is exact to half a unit each
    assert c.seconds["draft"] == pytest.approx(sum(o.stats["draft_s"] for o in outs), abs=0.5e-6 * len(outs) + 1e-9)
    assert sum(c.seconds.values()) == pytest.approx(sum(walls), rel=0.05, abs=2e-3)
    assert min(c.seconds.values()) > 0 and c.seconds["draft"] > 0.1 * sum(walls)


def test_policy_weighs_drafts_against_the_decode_rows_only(tiny):
    """A prefill chunk sharing the step must not make drafts look free: the policy's base is one token per decoding
    request, whatever prompt tokens the same forward computes."""
    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=3,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, scheduler="dspark")
    eng, seen = llm.engine, []
    draft_lengths, verify_lengths = eng.policy.draft_lengths, eng.policy.verify_lengths

    def note(base_tokens):
        seen.append((base_tokens, sum(lv.prefilled for lv in eng.running), len(eng.running)))

    def spy_draft(cands, base_tokens):  # asked every step a request speculates, whatever the timings decide
        note(base_tokens)
        return draft_lengths(cands, base_tokens)

    def spy_verify(cands, drafts, base_tokens):  # asked only where something was drafted
        note(base_tokens)
        return verify_lengths(cands, drafts, base_tokens)

    eng.policy.draft_lengths, eng.policy.verify_lengths = spy_draft, spy_verify
    reqs = [Request(p, prm) for p, prm in zip(PROMPTS, _params())]
    for i, r in enumerate(reqs):
        eng.add_request(r)
        for _ in range(4 if i < 3 else 0):  # later requests join while earlier ones decode
            eng.step()
    eng.run_to_completion()
    assert all(base == decoding for base, decoding, _ in seen)
    assert any(decoding < running for _, decoding, running in seen)  # steps that also prefilled a prompt


def test_request_that_can_never_fit_is_refused_and_others_run(tiny, references):
    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=40, max_num_seqs=2)
    with pytest.raises(RequestTooLong, match="exceeds the context of 40"):
        llm.generate({"prompt_token_ids": list(range(30))}, SamplingParams(max_tokens=20))
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, _params()[0], use_tqdm=False)[0]
    assert out.token_ids == references["llama"][0]


def test_abort_frees_slot_and_kv_at_once(tiny):
    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2,
              speculative_config={"method": "ngram"})
    eng = llm.engine
    a = Request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    b = Request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    waiting = Request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for r in (a, b, waiting):
        eng.add_request(r)
    for _ in range(3):
        eng.step()
    assert eng.kv_tokens() > 0 and len(eng.running) == 2
    assert eng.abort(a.request_id) and eng.abort(waiting.request_id)
    eng.step()  # the aborted request is released before this step's forward
    assert a.finish_reason == "abort" and waiting.finish_reason == "abort"
    assert [lv.req for lv in eng.running] == [b]
    assert eng.kv_tokens() == eng.cache.length(b.slot)
    eng.run_to_completion()
    assert eng.kv_tokens() == 0 and eng.kv_usage() == 0.0
    assert not eng.abort("no-such-request")


def test_the_engine_gives_its_probe_share_to_every_request_estimator(tiny):
    """`EngineConfig.probe_share` is what a running request's estimators (chain and tree) price probes with: the
    default 2%, or the share given."""
    import dataclasses

    from verispec.engine.acceptance import PROBE_SHARE
    from verispec.state.request import Request

    llm = LLM(tiny["llama"][0], dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "draft_tree": "auto"})
    assert llm.engine.config.probe_share == PROBE_SHARE == 0.02
    llm.engine.config = dataclasses.replace(llm.engine.config, probe_share=0.123)
    llm.engine.add_request(Request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    for _ in range(4):  # prefill, then decode steps with both shapes' estimators made
        llm.engine.step()
    live = llm.engine.running[0]
    assert live.estimator.probe_share == live.tree_estimator.probe_share == 0.123
    llm.engine.run_to_completion()
