"""Sampling controls (repetition / frequency / presence penalties, logit_bias, min_tokens, bad_words): the processed
logits against HF transformers' logits processors (and OpenAI's closed form where transformers has none), row by
row inside a speculative block, and greedy speculation token-identical to plain decoding with the same controls.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import EOS
from verispec import LLM, SamplingParams
from verispec.sampling.processor import ProcessorFactory

PROMPT = [5, 9, 9, 14, 3]


def _proc(tok, **kw):
    params = SamplingParams(**kw)
    return ProcessorFactory(tok, len(tok), [EOS]).new(params, PROMPT), params


def _rows(hf, output, draft):
    ids = torch.tensor([PROMPT + output + draft])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    n = len(PROMPT) + len(output)
    return logits[n - 1: n + len(draft)]  # row i predicts the token after output + draft[:i]


OUTPUT, DRAFT = [9, 20, 21, 20], [5, 20, 33]


def test_repetition_penalty_matches_transformers(hf, tok):
    from transformers import RepetitionPenaltyLogitsProcessor

    proc, _ = _proc(tok, repetition_penalty=1.7)
    raw = _rows(hf, OUTPUT, DRAFT)
    got = proc.process(raw, OUTPUT, DRAFT)
    ref = RepetitionPenaltyLogitsProcessor(1.7)
    for i in range(len(DRAFT) + 1):
        seen = torch.tensor([PROMPT + OUTPUT + DRAFT[:i]])
        torch.testing.assert_close(got[i], ref(seen, raw[i:i + 1].clone())[0])


def test_min_tokens_bad_words_and_bias_match_transformers(hf, tok):
    from transformers import MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor

    words = ["hello world", "cat"]
    proc, params = _proc(tok, min_tokens=6, bad_words=words, logit_bias={17: 5.0, 30: -3.0})
    raw = _rows(hf, OUTPUT, DRAFT)
    got = proc.process(raw, OUTPUT, DRAFT)
    seqs = proc.bad
    assert [tok.encode("cat", add_special_tokens=False)] == [s for s in seqs if tok.decode(s) == "cat"]
    bad = NoBadWordsLogitsProcessor(seqs, eos_token_id=EOS)
    bias = SequenceBiasLogitsProcessor({(17,): 5.0, (30,): -3.0})
    for i in range(len(DRAFT) + 1):
        out_ids = torch.tensor([OUTPUT + DRAFT[:i]])  # vLLM matches bad words against the output only
        row = bad(out_ids, raw[i:i + 1].clone())
        full = torch.tensor([PROMPT + OUTPUT + DRAFT[:i]])
        row = MinNewTokensLengthLogitsProcessor(len(PROMPT), 6, EOS)(full, row)
        row = bias(full, row)
        torch.testing.assert_close(got[i], row[0])
    assert torch.isinf(got[0][EOS]) and torch.isinf(got[1][EOS]), "fewer than 6 tokens before the row: EOS banned"
    assert not torch.isinf(got[2][EOS]), "the 4 output + 2 draft tokens before row 2 reach min_tokens"


def test_frequency_and_presence_penalties_closed_form(hf, tok):
    """OpenAI's definition: logit - count x frequency_penalty - (count > 0) x presence_penalty, counting the output
    (draft tokens before the row included), not the prompt."""
    proc, _ = _proc(tok, frequency_penalty=0.7, presence_penalty=-0.4)
    raw = _rows(hf, OUTPUT, DRAFT)
    got = proc.process(raw, OUTPUT, DRAFT)
    for i in range(len(DRAFT) + 1):
        expect = raw[i].clone()
        for t in set(OUTPUT + DRAFT[:i]):
            c = (OUTPUT + DRAFT[:i]).count(t)
            expect[t] -= 0.7 * c + (-0.4)
        torch.testing.assert_close(got[i], expect)
    assert got[1][20] != got[2][20], "the draft token 20 at row 1 counts for row 2 on"


@pytest.mark.parametrize("bad", [{"logit_bias": {"x": 1}}, {"repetition_penalty": 0}, {"presence_penalty": 3},
                                 {"min_tokens": -1}, {"bad_words": [""]}])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


CONTROLS = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=0.3),
            dict(logit_bias={100: 4.0, 200: 3.0}, min_tokens=12),
            dict(bad_words=["the", "and"], repetition_penalty=1.1, frequency_penalty=0.2)]
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7, 7, 300, 301], list(range(400, 410))]


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", device="cpu", progress=False)


@pytest.mark.parametrize("controls", CONTROLS, ids=["repetition", "freq-presence", "bias-min", "bad-words"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_speculation_equals_plain_with_controls(plain, controls, method):
    def run(llm):
        ps = SamplingParams(temperature=0, max_tokens=40, **controls)
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], ps, use_tqdm=False)

    ref = run(plain)
    fast = plain.with_speculation({"method": method, "num_speculative_tokens": 4, "adaptive": False},
                                  check_state=True)
    got = run(fast)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    unconstrained = plain.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                   SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert [u.token_ids for u in unconstrained] != [r.token_ids for r in ref], "the controls must change something"


def test_greedy_draft_model_with_controls(plain, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.helpers import CTX, VOCAB

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CTX, eos_token_id=EOS)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    ps = SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.4, frequency_penalty=0.3)
    ref = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], ps, use_tqdm=False)
    fast = plain.with_speculation({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3,
                                   "adaptive": False}, check_state=True)
    got = fast.generate([{"prompt_token_ids": p} for p in PROMPTS], ps, use_tqdm=False)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
