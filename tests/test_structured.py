"""Structured outputs under speculation: the grammar's masks against an independent reference, bad grammars
refused before decoding, greedy speculation token-identical to plain constrained decoding for every model-free,
draft-model and learned drafter and every scheduler (the state oracle on, the grammar matcher included), outputs valid by
`jsonschema`, forced tokens verified as drafts, and constrained sampling's exact distribution (chi-square against
the per-step masked, renormalised target computed from HF transformers, with a negative control that must fail).
"""

from __future__ import annotations

import itertools
import json
import re
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from tests.helpers import EOS, LENGTH, PROMPT, V, chi2_pvalue, continuation_index, tiny_vocab_model
from verispec import LLM, SamplingParams
from verispec.drafters.base import Draft
from verispec.sampling.grammar import GrammarError, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"enum": ["cat", "dog", "bird"]},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                    "maxItems": 2}},
          "required": ["name", "age", "kind", "tags"], "additionalProperties": False}
SPECS = [{"json": SCHEMA}, {"regex": r"(yes|no), because [a-z ]{1,20}\."}, {"choice": ["alpha", "beta", "gamma"]},
         {"grammar": 'root ::= "x" [0-9]+ ("," [0-9]+)* "."'}, {"json_object": True}]


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.helpers import CTX, VOCAB

    torch.manual_seed(3)
    d = tmp_path_factory.mktemp("tiny-draft")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CTX, eos_token_id=EOS)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return str(d)


def test_masks_match_an_independent_reference(plain, tok):
    """The matcher's allowed tokens for a `choice` grammar, after each prefix, are exactly the vocabulary entries
    whose text extends the prefix toward one of the choices (computed by string matching over the vocabulary)."""
    choices = ["alpha", "beta", "alps"]
    m = plain.processors.compiler.matcher(StructuredOutputsParams(choice=choices))
    texts = {i: tok.decode([i]) for i in range(len(tok))}
    for prefix in ["", "al", "alp"]:
        ids = tok(prefix, add_special_tokens=False)["input_ids"] if prefix else []
        allowed = set(m.masks([ids])[0].nonzero()[0].tolist())
        expect = {i for i, t in texts.items() if t and any(c.startswith(prefix + t) for c in choices)}
        assert expect <= allowed, f"after {prefix!r}: tokens the grammar should allow are masked"
        extra = {i for i in allowed - expect if i not in plain.eos_ids}
        assert not extra, f"after {prefix!r}: allowed tokens no choice continues with: {[texts[i] for i in extra][:5]}"


@pytest.mark.parametrize("spec, words", [({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
                                          "json"),
                                         ({"regex": "(unclosed"}, "regex"), ({"grammar": "root ::= ("}, "grammar"),
                                         ({"json": "{not json"}, "json")])
def test_bad_grammars_are_refused_before_decoding(plain, spec, words):
    with pytest.raises(GrammarError, match=words):
        plain.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, structured_outputs=spec),
                       use_tqdm=False)
    assert not plain.engine.has_work()


def test_spec_params_take_exactly_one_kind():
    with pytest.raises(GrammarError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(GrammarError, match="exactly one"):
        SamplingParams(structured_outputs={})


def _run(llm, spec, prompts, temperature=0.0, max_tokens=60):
    ps = [SamplingParams(temperature=temperature, max_tokens=max_tokens, structured_outputs=spec, seed=i)
          for i in range(len(prompts))]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [900, 901, 900, 901], list(range(400, 420))]


def _check_valid(spec, out):
    if out.finish_reason != "stop":
        return
    if "json" in spec:
        jsonschema.validate(json.loads(out.text), spec["json"])
    elif "json_object" in spec:
        assert isinstance(json.loads(out.text), dict)
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], out.text), out.text
    elif "choice" in spec:
        assert out.text in spec["choice"]


@pytest.mark.parametrize("spec", SPECS, ids=["json", "regex", "choice", "gbnf", "json_object"])
@pytest.mark.parametrize("method", ["ngram", "suffix", pytest.param("draft_model", marks=pytest.mark.slow)])
def test_greedy_speculation_equals_plain_constrained(plain, draft_dir, spec, method):
    ref = _run(plain, spec, PROMPTS)
    cfg = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "draft_model":
        cfg["model"] = draft_dir
    fast = plain.with_speculation(cfg, check_state=True)
    got = _run(fast, spec, PROMPTS)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        _check_valid(spec, r)
    if "json" in spec or "regex" in spec:  # keys, punctuation, ", because ": forced tokens at least
        assert sum(o.stats["num_draft_tokens"] for o in got) > 0, "drafts must be verified"


@pytest.fixture(scope="module")
def learned_dirs(plain, tmp_path_factory):
    """Random EAGLE-3, DFlash and DSpark drafters for the tiny target (tests/helpers.py's)."""
    from tests.helpers import random_dspark, random_eagle3_head

    root = tmp_path_factory.mktemp("learned")
    random_eagle3_head(plain.model, root / "eagle3")
    random_dspark(plain.model, root / "dspark")
    random_dspark(plain.model, root / "dflash", dspark=False)
    return root


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_learned_drafters_under_a_grammar_equal_plain_constrained(plain, learned_dirs, method):
    """A drafter that reads the target's hidden states keeps them whole while the grammar cuts its drafts or
    forced tokens replace them (the state oracle checks its features after every step); greedy output is plain
    constrained decoding's, JSON and regex alike."""
    fast = plain.with_speculation({"method": method, "model": str(learned_dirs / method), "num_speculative_tokens": 4,
                                   "adaptive": False}, check_state=True)
    for spec in SPECS[:2]:
        ref = _run(plain, spec, PROMPTS)
        got = _run(fast, spec, PROMPTS)
        assert [g.token_ids for g in got] == [r.token_ids for r in ref]
        for r in ref:
            _check_valid(spec, r)


@pytest.mark.parametrize("scheduler", ["static", "goodput", "dspark"])
def test_every_scheduler_and_batching_keep_greedy_identity(plain, scheduler):
    spec = SPECS[0]
    ref = _run(plain, spec, PROMPTS)
    fast = plain.with_speculation({"method": "ngram", "num_speculative_tokens": 4}, check_state=True)
    fast.configure_engine(scheduler=scheduler)
    got = _run(fast, spec, PROMPTS)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    assert all(r.finish_reason == "stop" for r in ref), "the schema's bounds must end every answer"
    for r in ref:
        _check_valid(spec, r)


def test_forced_tokens_are_drafted_and_accepted(plain):
    """A JSON schema's keys and punctuation are forced: with the n-gram drafter (which finds nothing in a random
    model's output) most verified drafts are the grammar's, and nearly all of them are accepted."""
    fast = plain.with_speculation({"method": "ngram", "num_speculative_tokens": 6, "adaptive": False})
    out = _run(fast, SPECS[0], [[5, 6, 7]])[0]
    assert out.stats["num_draft_tokens"] >= 8
    assert out.stats["num_accepted_tokens"] >= 0.5 * out.stats["num_draft_tokens"]


class _Drafter:
    """Proposes the given continuation and remembers the contexts it was asked to continue."""

    def __init__(self, tokens, context_only=True):
        self.tokens, self.contexts, self.reads_context_only = list(tokens), [], context_only


class _Live:
    """The parts of a LiveRequest that `constrain.propose` reads."""

    def __init__(self, proc, drafter, output):
        self.proc, self.drafter, self.output = proc, drafter, list(output)
        self.forced = self.forced_tail = 0
        self.tree_now = False

    def propose(self, k, floor=0.0, after=()):
        self.drafter.contexts.append(self.output + list(after))
        toks = self.drafter.tokens[:k]
        return Draft(toks, confidence=[0.9 ** (i + 1) for i in range(len(toks))])


def test_drafts_run_through_the_grammar(plain):
    """`constrain.propose` at every state of an output where the grammar forces tokens: the draft is the forced
    tokens, then the drafter's chain (asked to continue the output plus those tokens), cut where the grammar
    forbids a token, then what a fresh matcher fed all of that forces next; confidence 1 on the forced head, the
    drafter's on its chain, the chain's last on the forced tail. A drafter that reads more than its context is not
    asked where tokens are forced."""
    from verispec.engine import constrain

    spec = StructuredOutputsParams.from_any(SPECS[0])
    m, ids = _walk_states(plain, SPECS[0], PROMPTS[0])
    proc = SimpleNamespace(forced=m.forced, cut=m.valid_prefix, forced_after=m.forced_after)
    k, limit, seen = 4, 12, 0
    for i in range(len(ids) - 1):
        head = m.forced(limit)
        wanted = ids[i + len(head): i + len(head) + k - 1] + [EOS]  # then one the grammar forbids mid-answer
        if head and i + len(head) < len(ids) and EOS not in wanted[:-1]:
            lv = _Live(proc, _Drafter(wanted), ids[:i])
            d = constrain.propose(lv, k, 0.0, limit)
            assert lv.drafter.contexts == [ids[:i] + head]
            fresh = plain.processors.compiler.matcher(spec)
            fresh.commit(ids[:i] + head)
            n = 0
            while n < len(wanted) and fresh.masks([[]])[0][wanted[n]]:  # the full bitmask, not validate_tokens
                fresh.commit([wanted[n]])
                n += 1
            tail = fresh.forced(limit - len(head) - n) if n else []
            assert d.tokens == head + wanted[:n] + tail, i
            if n:
                assert d.confidence == [1.0] * len(head) + [0.9 ** (j + 1) for j in range(n)] + [0.9 ** n] * len(tail)
                seen += bool(tail)
            other = _Live(proc, _Drafter(wanted, context_only=False), ids[:i])
            assert constrain.propose(other, k, 0.0, limit).tokens == head and other.drafter.contexts == []
        m.commit([ids[i]])
    assert seen > 0, "some chain must be followed by forced tokens"


def test_forced_after_is_what_a_matcher_fed_those_tokens_forces(plain):
    """`Matcher.forced_after(tokens, k)` at every state of an output against a fresh matcher committed the output so
    far and then those tokens (llguidance's own fast-forward there), and the matcher's state is unchanged after."""
    spec = StructuredOutputsParams.from_any(SPECS[0])
    m, ids = _walk_states(plain, SPECS[0], PROMPTS[0])
    checked = 0
    for i in range(len(ids)):
        for j in range(i + 1, min(i + 4, len(ids)) + 1):
            before = m.state_key()
            got = m.forced_after(ids[i:j], 8)
            assert m.state_key() == before
            fresh = plain.processors.compiler.matcher(spec)
            fresh.commit(ids[:j])
            assert got == fresh.forced(8), (i, j)
            checked += bool(got)
        m.commit([ids[i]])
    assert checked > 3, "the schema's keys must be forced after some values"


def test_sampled_outputs_stay_in_the_grammar(plain):
    fast = plain.with_speculation({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
                                  check_state=True)
    for spec in SPECS:
        for out in _run(fast, spec, PROMPTS, temperature=1.0, max_tokens=80):
            _check_valid(spec, out)


def _walk_states(llm, spec, prompt):
    """(a fresh matcher, the output tokens of greedy constrained decoding): the states the tests below visit."""
    out = _run(llm, spec, [prompt], max_tokens=40)[0]
    return llm.processors.compiler.matcher(StructuredOutputsParams.from_any(spec)), list(out.token_ids)


@pytest.mark.parametrize("spec", SPECS, ids=["json", "regex", "choice", "gbnf", "json_object"])
def test_allows_never_admits_a_token_the_mask_forbids(plain, spec):
    """`Matcher.allows` (the greedy rows' shortcut) against llguidance's full next-token bitmask at every state of
    an output: a token it allows is always in the mask (the other way round it may say no: the mask is then
    filled), and it does allow tokens, so the shortcut is taken."""
    m, ids = _walk_states(plain, spec, PROMPTS[2])
    gen = torch.Generator().manual_seed(0)
    said_yes = 0
    for t in ids + [None]:
        mask = m.masks([[]])[0]
        probe = set(torch.randint(0, len(mask), (1500,), generator=gen).tolist())
        probe |= set(mask.nonzero()[0][:300].tolist()) | set(plain.eos_ids)
        for x in probe:
            if m.allows(x):
                said_yes += 1
                assert mask[x], f"allows({x}) but the mask forbids it"
        if t is None or m.m.is_stopped():
            break
        m.commit([t])
    if len(ids) > 2:  # json_object's answer here is "{}": its states are all forced or final
        assert said_yes > len(ids), "the shortcut must apply at most states"


def test_walking_past_the_end_and_back_keeps_the_state(plain):
    """A walk over [last token, EOS] and back (llguidance takes the EOS after the end without a history entry, so
    rolling back two tokens would undo one too many) leaves the matcher where a fresh one fed the same output is."""
    m, ids = _walk_states(plain, SPECS[0], PROMPTS[1])
    assert ids[-1] in plain.eos_ids, "the schema's bounds end the answer"
    m.commit(ids[:-2])
    fresh = plain.processors.compiler.matcher(StructuredOutputsParams.from_any(SPECS[0]))
    fresh.commit(ids[:-2])
    m.chain_masks(ids[-2:])
    m.masks([ids[-2:]])
    assert m.state_key() == fresh.state_key()
    assert m.valid_prefix([ids[-2]]) == 1


@pytest.mark.parametrize("spec", SPECS[:3], ids=["json", "regex", "choice"])
def test_greedy_rows_pick_what_the_full_mask_picks(plain, spec):
    """Greedy chains skip the mask where a row's argmax is allowed: on random logits (most argmaxes forbidden, some
    moved onto an allowed token) and drafts of 0-3 allowed tokens, each processed row's argmax equals the argmax of
    the same row under the full mask (`chain_masks`, llguidance's bitmask)."""
    from verispec.sampling.processor import RequestProcessor

    m, ids = _walk_states(plain, spec, PROMPTS[1])
    params = SamplingParams(temperature=0, structured_outputs=spec)
    proc = RequestProcessor(params, [1], plain.model.cfg.vocab_size, plain.eos_ids, m, [])
    gen = torch.Generator().manual_seed(1)
    lazy = 0
    for at in range(len(ids)):
        draft = ids[at : at + int(torch.randint(0, 4, (1,), generator=gen))]
        draft = draft[: m.valid_prefix(draft)]  # as the engine cuts drafts (an EOS after the end is cut)
        logits = torch.randn(len(draft) + 1, plain.model.cfg.vocab_size, generator=gen)
        full = torch.from_numpy(m.chain_masks(draft)[:, : logits.shape[1]])
        for i in range(logits.shape[0]):
            if torch.rand(1, generator=gen) < 0.5:  # move the maximum onto an allowed token
                ok = full[i].nonzero()[:, 0]
                logits[i, ok[int(torch.randint(0, len(ok), (1,), generator=gen))]] = 50.0
        got = proc.process(logits, ids[:at], draft).argmax(1)
        want = logits.masked_fill(~full, float("-inf")).argmax(1)
        assert got.tolist() == want.tolist(), f"at {at} with draft {draft}"
        lazy += int((got == logits.argmax(1)).sum())
        m.commit([ids[at]])
    assert lazy > 0


# ---- constrained sampling is exact: a 5-token vocabulary, a regex over three of its letters ----------------------

LETTERS = {0: "a", 3: "b", 4: "c"}  # token id -> text; 1 and 2 are BOS / EOS
REGEX = r"(a|b)(b|c)[abc]"


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "<s>": 1, "</s>": 2, "b": 3, "c": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.decoder = decoders.ByteLevel()  # llguidance reads token bytes through the decoder (ASCII letters map to themselves)
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")


def constrained_distribution(hf) -> torch.Tensor:
    """P(x1 x2 x3) when each token is drawn from the target's distribution masked to the letters that can still
    complete the regex (Python's `re`, not llguidance) and renormalised; rows in continuation_index order."""
    words = {"".join(w) for w in itertools.product("abc", repeat=LENGTH) if re.fullmatch(REGEX, "".join(w))}
    seqs = list(itertools.product(range(V), repeat=LENGTH))
    out = torch.zeros(len(seqs))
    with torch.no_grad():
        for row, seq in enumerate(seqs):
            text = "".join(LETTERS.get(t, "?") for t in seq)
            if text not in words:
                continue
            logits = hf(torch.tensor([PROMPT + list(seq)])).logits[0, len(PROMPT) - 1:].float()
            prob = 1.0
            for i, t in enumerate(seq):
                allowed = [j for j, c in LETTERS.items() if any(w.startswith(text[:i] + c) for w in words)]
                p = logits[i, allowed].softmax(-1)
                prob *= float(p[allowed.index(t)])
            out[row] = prob
    return out


@pytest.fixture(scope="module")
def vocab_models(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("g-target"), tmp_path_factory.mktemp("g-draft")
    hf = tiny_vocab_model(target_dir, 0, 8.0)
    tiny_vocab_model(draft_dir, 1, 8.0)
    return hf, str(target_dir), str(draft_dir)


def _sample_counts(llm, n, **spec_kw):
    from verispec.sampling.processor import ProcessorFactory

    llm._processors = ProcessorFactory(tiny_tokenizer(), V, llm.eos_ids)
    counts = torch.zeros(V ** LENGTH)
    drafted = 0
    for seed in range(n):
        out = llm.generate({"prompt_token_ids": PROMPT},
                           SamplingParams(temperature=1.0, max_tokens=LENGTH, seed=seed, ignore_eos=True,
                                          structured_outputs={"regex": REGEX}), use_tqdm=False)[0]
        counts[continuation_index(out.token_ids)] += 1
        drafted += out.stats["num_draft_tokens"]
    return counts, drafted


@pytest.mark.slow
def test_constrained_speculative_sampling_is_exact(vocab_models):
    hf, target_dir, draft_dir = vocab_models
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(target_dir, dtype="float32", device="cpu", speculative_config=spec, progress=False)
    counts, drafted = _sample_counts(llm, 6000)
    assert drafted > 1000, "drafts must be verified for this test to mean anything"
    exact = constrained_distribution(hf)
    assert counts[exact == 0].sum() == 0, "a sample outside the grammar"
    pval = chi2_pvalue(counts, exact)
    assert pval > 1e-3, f"constrained speculative samples do not follow the masked target (p = {pval:.2e})"


@pytest.mark.slow
def test_negative_control_lossy_rule_is_rejected(vocab_models):
    """The same run with a lossy acceptance rule (accept a draft token whenever the masked target gives it 5%):
    its samples stay in the grammar, and the chi-square test must reject them at a third of the samples."""
    hf, target_dir, draft_dir = vocab_models
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 2, "adaptive": False,
            "acceptance_rule": "threshold", "threshold_single": 0.05}
    llm = LLM(target_dir, dtype="float32", device="cpu", speculative_config=spec, progress=False)
    counts, _ = _sample_counts(llm, 2000)
    exact = constrained_distribution(hf)
    assert counts[exact == 0].sum() == 0, "a sample outside the grammar"
    assert chi2_pvalue(counts, exact) < 1e-3
