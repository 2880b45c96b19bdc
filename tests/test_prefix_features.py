"""Prefix caching with drafters that read the target's hidden states (EAGLE-3, DFlash, DSpark): the cache keeps
each committed position's features beside its K/V, a hit skips both, and the new drafter is handed the kept ones.

References, none of them the code under test: greedy and seeded output of plain decoding without prefix caching
(the engine with no drafter, one request at a time); the state oracle (check_state), which recomputes the
drafter's features from scratch after every step; and the same drafter with prefix caching off, whose drafts (and
so its accepted counts) must be the same ones: the kept features are the forward's own numbers. A store that hands
the drafter wrong features must fail the oracle (negative control).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import random_dspark, random_eagle3_head
from verispec import LLM, SamplingParams
from verispec.check.state import StateMismatch
from verispec.models.loader import load_model
from verispec.state.paged_kv import PagedKVCache

B = 4  # block size: short prompts span many blocks
TURN1 = [1, 3, 0, 4, 4, 1, 0, 3, 1, 1, 4, 0, 2, 3, 3, 1, 0, 4, 1]  # 19 tokens
TAIL = [2, 0, 1, 3, 4]
METHODS = ["eagle3", "dflash", "dspark"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("prefix_features")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)
    hf.save_pretrained(root / "target")
    model, _ = load_model(str(root / "target"), dtype="float32", device="cpu", progress=False)
    random_eagle3_head(model, root / "eagle3")
    random_dspark(model, root / "dspark")
    random_dspark(model, root / "dflash", dspark=False)
    return {"target": root / "target", **{m: root / m for m in METHODS}}


def _llm(dirs, method: str | None, prefix: bool, **kw) -> LLM:
    spec = None if method is None else {"method": method, "model": str(dirs[method]), "num_speculative_tokens": 3,
                                        "adaptive": False}
    return LLM(str(dirs["target"]), dtype="float32", progress=False, max_model_len=96, block_size=B,
               speculative_config=spec, enable_prefix_caching=prefix, scheduler="static", **kw)


def _two_turns(llm: LLM, params: SamplingParams) -> tuple[list[int], list[int], list[int]]:
    """Turn 1, then turn 2 whose prompt repeats turn 1's prompt and answer: (answer 1, prompt 2, answer 2)."""
    first = llm.generate({"prompt_token_ids": TURN1}, params, use_tqdm=False)[0].token_ids
    second_prompt = TURN1 + first + TAIL
    second = llm.generate({"prompt_token_ids": second_prompt}, params, use_tqdm=False)[0]
    return first, second_prompt, second.token_ids


@pytest.mark.parametrize("method", METHODS)
def test_second_turn_hits_the_first_turn_s_prompt_and_answer_and_drafts_as_without_the_cache(dirs, method):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = _llm(dirs, None, False)
    cached = _llm(dirs, method, True, check_state=True)  # the oracle checks the fed features after every step
    fresh = _llm(dirs, method, False)
    a1, p2, a2 = _two_turns(cached, greedy)
    assert a1 == plain.generate({"prompt_token_ids": TURN1}, greedy, use_tqdm=False)[0].token_ids
    assert a2 == plain.generate({"prompt_token_ids": p2}, greedy, use_tqdm=False)[0].token_ids
    # turn 1 committed its prompt and all but its last answer token: those full blocks are hit (turn 2 computes
    # its own last token, so never more than len(p2) - 1 positions)
    committed = len(TURN1) + len(a1) - 1
    assert cached.cache.prefix_hits == min(committed, len(p2) - 1) // B * B
    assert cached.cache.prefix_hits > len(TURN1), "the answer's blocks were named too"
    # the drafter fed from the cache drafts exactly as one that computed every position
    _, _, fresh_a2 = _two_turns(fresh, greedy)
    assert fresh_a2 == a2
    with_cache = cached.generate({"prompt_token_ids": p2}, greedy, use_tqdm=False)[0]
    without = fresh.generate({"prompt_token_ids": p2}, greedy, use_tqdm=False)[0]
    assert with_cache.stats["num_accepted_tokens"] == without.stats["num_accepted_tokens"]
    assert with_cache.stats["per_position_acceptance"] == without.stats["per_position_acceptance"]
    cached.cache.check()


@pytest.mark.parametrize("method", ["eagle3", "dspark"])
def test_seeded_sampling_with_prefix_hits_is_plain_seeded_sampling(dirs, method):
    params = SamplingParams(temperature=0.9, max_tokens=14, ignore_eos=True, seed=5)
    plain = _llm(dirs, None, False)
    a1, p2, a2 = _two_turns(_llm(dirs, method, True, check_state=True), params)
    assert a1 == plain.generate({"prompt_token_ids": TURN1}, params, use_tqdm=False)[0].token_ids
    assert a2 == plain.generate({"prompt_token_ids": p2}, params, use_tqdm=False)[0].token_ids


def test_concurrent_requests_sharing_a_prefix_with_a_feature_drafter(dirs):
    """Requests arriving together wait for the blocks another is computing, then hit them; every output is the
    plain one and the oracle passes at every step."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [TURN1 + [t] for t in range(5)]
    llm = _llm(dirs, "eagle3", True, check_state=True, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    plain = _llm(dirs, None, False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == plain.generate({"prompt_token_ids": p}, greedy, use_tqdm=False)[0].token_ids
    assert llm.cache.prefix_hits >= 4 * (len(TURN1) // B * B)


def test_wrong_kept_features_fail_the_state_oracle(dirs, monkeypatch):
    """Negative control: a store that hands the drafter zeros for the hit positions is caught."""
    real = PagedKVCache.read_features
    monkeypatch.setattr(PagedKVCache, "read_features", lambda self, slot, n: torch.zeros_like(real(self, slot, n)))
    llm = _llm(dirs, "eagle3", True, check_state=True)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate({"prompt_token_ids": TURN1}, greedy, use_tqdm=False)
    with pytest.raises((AssertionError, StateMismatch)):
        llm.generate({"prompt_token_ids": TURN1 + [2, 2]}, greedy, use_tqdm=False)


def test_return_hidden_states_requests_prefill_everything(dirs):
    llm = _llm(dirs, "eagle3", True)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate({"prompt_token_ids": TURN1}, greedy, use_tqdm=False)
    hits = llm.cache.prefix_hits
    llm.generate({"prompt_token_ids": TURN1}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                             return_hidden_states=[0]), use_tqdm=False)
    assert llm.cache.prefix_hits == hits


# ---- the cache's bookkeeping, on its own ----------------------------------------------------------------------


def _cache(blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(1, 1, 2, 64, blocks, B, num_slots=2, prefix_caching=True)


def _fill(cache: PagedKVCache, slot: int, n: int, layers=(0,), feats: bool = True) -> torch.Tensor:
    """Commit n positions of `slot` in one block, writing features (n rows of 3 values) unless `feats` is off."""
    start = cache.reserve(slot, n)
    cache.commit(slot, n)
    f = torch.arange(start * 3, (start + n) * 3, dtype=torch.float32).reshape(n, 3)
    if feats:
        cache.write_features(layers, slot, start, f)
    return f


def test_a_block_serves_a_drafter_only_with_all_its_features_for_its_layers():
    cache = _cache()
    prompt = list(range(12))
    s = cache.allocate(prompt)
    f = _fill(cache, s, 10)  # blocks 0, 1 full, block 2 half: two blocks named
    cache.free(s)
    assert len(cache.match(prompt, 12)) == 2
    assert len(cache.match(prompt, 12, (0,))) == 2
    assert cache.match(prompt, 12, (1,)) == []  # kept for other layers
    t = cache.allocate(prompt, cache.match(prompt, 12, (0,)))
    assert torch.equal(cache.read_features(t, 8), f[:8])
    cache.free(t)
    # a sequence that committed without features: its blocks are hits for plain requests, misses for drafters
    other = [20 + i for i in range(8)]
    u = cache.allocate(other)
    _fill(cache, u, 8, feats=False)
    cache.free(u)
    assert len(cache.match(other, 8)) == 2 and cache.match(other, 8, (0,)) == []


def test_a_reused_block_forgets_its_features_and_output_blocks_are_named_at_the_end():
    cache = _cache(blocks=3)
    s = cache.allocate([1, 2, 3, 4])
    _fill(cache, s, 4)
    cache.free(s)
    assert len(cache.match([1, 2, 3, 4, 5], 4, (0,))) == 1
    t = cache.allocate([9, 9, 9, 9])
    _fill(cache, t, 12, feats=False)  # takes all three blocks: the cached one is evicted and rewritten
    cache.free(t)
    assert cache.match([1, 2, 3, 4, 5], 4, (0,)) == []
    # output blocks: named by the whole stream as the sequence finishes
    u = cache.allocate([5, 6])
    _fill(cache, u, 9)  # 2 prompt + 7 output positions committed (the 8th output token has no K/V yet)
    stream = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    cache.register_tokens(u, stream)
    cache.free(u)
    assert len(cache.match(stream, len(stream), (0,))) == 2
    assert cache.match([5, 6, 7, 0], 4) == []
    cache.check()
