"""Replaying a drafter over a recorded text (bench/replay.py), counted as an engine counts: the reference is the
engine itself, which generated the text with the same drafter at a fixed K, and whose speculative counters must
equal the replay's (drafts, accepted) exactly: steps begin after the prefill's token, drafts stop at the output's
end. The interop benchmark relies on it to score our drafter on another engine's texts."""

from __future__ import annotations

import pytest

from tests.helpers import random_dspark, random_eagle3_head, sharp_llama
from verispec import LLM, SamplingParams
from verispec.bench.replay import engine_counts
from verispec.execution.features import capture_forward, select

PROMPTS = [[1, 3, 0, 4, 4, 1, 0, 3], [2, 2, 1, 0, 4], [4, 0, 3, 3, 1, 2, 0, 1, 4, 4, 2]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    _, model = sharp_llama(root / "target", 3, vocab_size=5, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=128, tie_word_embeddings=False)
    random_eagle3_head(model, root / "eagle3")
    random_dspark(model, root / "dspark")
    return root


@pytest.mark.parametrize("method,k", [("ngram", 3), ("eagle3", 3), ("dspark", 3), ("eagle3", 5)])
def test_replay_counts_what_the_engine_counted_on_its_own_text(dirs, method, k):
    spec = {"method": method, "num_speculative_tokens": k, "adaptive": False}
    if method != "ngram":
        spec["model"] = str(dirs / method)
    llm = LLM(str(dirs / "target"), dtype="float32", progress=False, max_model_len=96, speculative_config=spec,
              scheduler="static")
    layers = llm.drafters.feature_layers
    c = llm.engine.counters
    for n, ids in enumerate(PROMPTS):
        d0, a0 = c.num_drafts, c.num_accepted_tokens
        params = SamplingParams(temperature=0, max_tokens=17 + n, ignore_eos=True)
        out = list(llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids)
        feats = select(capture_forward(llm.model, ids + out, layers).hidden, layers) if layers else None
        got = engine_counts(llm.drafters.new(SamplingParams(temperature=0), len(ids)), ids, out, k, feats)
        assert got == (c.num_drafts - d0, c.num_accepted_tokens - a0)
        assert got[0] > 0
