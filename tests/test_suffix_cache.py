"""The suffix cache across requests: bounded by requests and by tokens, and other requests' outputs reach a request
only as drafts. A cache planted with continuations that contradict the target (the tail of each prompt followed by
other tokens) makes the drafter propose them, and every output is still HF transformers' greedy output alone."""

from __future__ import annotations

import pytest

from tests.helpers import hf_greedy, sharp_llama
from verispec import LLM, SamplingParams
from verispec.drafters.suffix import SuffixCache, SuffixConfig, SuffixDrafter

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [11, 12, 13, 14, 15], [20, 21, 20, 21, 20], [9, 8, 7, 6, 5, 4]]
N = 24


def test_the_cache_keeps_the_newest_outputs_within_its_token_bound():
    cache = SuffixCache(SuffixConfig(max_tree_depth=8, max_cached_tokens=10))
    a, b, c = [50, 51, 52, 53], [60, 61, 62, 63], [70, 71, 72, 73]
    for out in (a, b, c):
        cache.add_output(out)
    assert len(cache) == 2 and cache.tokens == 8  # a went: 12 tokens > 10
    probe = lambda ctx: SuffixDrafter(cache, prompt_len=0).propose(ctx, 2).tokens
    assert probe([1, 50, 51]) == [] and probe([1, 60, 61]) == [62, 63] and probe([1, 70, 71]) == [72, 73]
    cache.add_output(list(range(100, 120)))  # longer than the bound alone: its last 10 tokens
    assert len(cache) == 1 and cache.tokens == 10 and probe([1, 60, 61]) == [] and probe([1, 113, 114]) == [115, 116]
    assert cache.trie.root.total == 10
    with pytest.raises(ValueError, match="max_cached_tokens"):
        SuffixConfig(max_cached_tokens=-1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharp")
    hf, _ = sharp_llama(d, seed=11, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return str(d), [hf_greedy(hf, p, N) for p in PROMPTS]


@pytest.mark.parametrize("scheduler", ["static", "dspark"])
def test_other_requests_outputs_reach_a_request_only_as_drafts(target, scheduler):
    path, refs = target
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=2, scheduler=scheduler,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    cache = llm.drafters.suffix_cache
    for p, ref in zip(PROMPTS, refs):  # the prompt's tail, then a continuation the target would not produce
        wrong = [(t + 1) % 128 for t in ref]
        cache.add_output(p[-3:] + wrong)
        cache.add_output(p[-3:] + wrong)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    drafted = sum(o.stats["num_draft_tokens"] for o in outs)
    accepted = sum(o.stats["num_accepted_tokens"] for o in outs)
    if scheduler == "static":  # every proposal verified: the planted drafts were proposed, and rejected
        assert drafted > accepted
    # the outputs joined the cache, and a second pass, drafting from them, gives the same outputs again
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.token_ids for o in again] == refs
    assert sum(o.stats["num_accepted_tokens"] for o in again) > 0
