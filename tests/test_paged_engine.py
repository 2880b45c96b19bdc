"""The engine on the paged KV cache: a pool too small for every request at once preempts and recomputes, and
every output still equals HF's greedy output for the request alone (or, sampled, the same request run alone);
prefix caching shares a system prompt's blocks (hits counted exactly, outputs unchanged, shared blocks never
modified), and the counters reach the engine snapshot and /metrics."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import hf_greedy
from verispec import LLM, SamplingParams
from verispec.state.request import Request

PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3],
    [7, 7, 7, 7],
    [10, 20, 30, 10, 20, 30, 10],
    list(range(40, 50)),
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 5, 6, 7],
]
MAX_TOKENS = [30, 12, 25, 20, 16]
SYSTEM = [(7 * i + 3) % 59 for i in range(37)]  # a shared "system prompt": 9 full blocks of 4 and one token
TAILS = [[1, 2, 3], [4, 5], [9, 9, 9, 9, 9, 1]]
BLOCK = 4
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 8 * 4  # K and V x 2 layers x 2 KV heads x 4 positions x head dim 8 x fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(11)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)  # sharper distributions: repeated runs for the drafters to find
    d = tmp_path_factory.mktemp("llama")
    m.save_pretrained(d)
    return str(d), m


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _llm(path: str, method: str = "none", **kw) -> LLM:
    spec = None if method == "none" else {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, speculative_config=spec, progress=False,
               block_size=BLOCK, **kw)


@pytest.mark.parametrize("method,prefix", [("none", False), ("ngram", False), ("draft_model", False),
                                           ("ngram", True), ("ngram+draft_model", False)])
def test_pool_too_small_for_all_preempts_and_every_output_matches_hf(tiny, method, prefix):
    """With prefix caching, a preempted request's own prompt blocks stay cached and are hit when it comes back.
    ngram+draft_model: a hybrid (its two sides' state across preemption, the draft model's KV slot given back)."""
    path, hf = tiny
    hybrid, _, method = method.rpartition("+")
    spec_path = {"draft_model": path}.get(method)
    # 14 blocks of 4: the longest request alone needs 10, all five at once about 40
    llm = _llm(path, "none", max_num_seqs=5, kv_cache_memory_bytes=14 * BLOCK_BYTES, check_state=True,
               enable_prefix_caching=prefix)
    if method != "none":
        llm = llm.with_speculation({"method": method, "model": spec_path, "num_speculative_tokens": 3,
                                    "adaptive": False, **({"hybrid": hybrid} if hybrid else {})})
    assert llm.cache.pool.num_blocks == 14
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [_greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    for p, n, out in zip(PROMPTS, MAX_TOKENS, outs):
        assert out.token_ids == hf_greedy(hf, p, n), f"prompt {p}"
    assert llm.engine.num_preemptions > 0, "the pool was meant to run out"
    assert (llm.cache.prefix_hits > 0) == prefix
    assert llm.cache.pool.num_used == 0 and llm.engine.kv_usage() == 0.0
    llm.cache.check()


def test_a_preempted_request_s_output_reaches_the_suffix_cache_once_and_whole(tiny):
    """Preemption releases the request's drafter before the request ends; the readmitted request's new drafter
    hands on the whole output at the end. The shared cache holds each output exactly once (before: the partial
    output at preemption too, so its tokens were counted twice)."""
    path, hf = tiny
    llm = _llm(path, "suffix", max_num_seqs=5, kv_cache_memory_bytes=14 * BLOCK_BYTES)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [_greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    assert llm.engine.num_preemptions > 0, "the pool was meant to run out"
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert sorted(llm.drafters.suffix_cache._outputs) == sorted(o.token_ids for o in outs)


def test_preempted_sampled_request_continues_its_own_random_stream(tiny):
    path, _ = tiny
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i) for i, n in enumerate(MAX_TOKENS)]
    alone = [_llm(path, max_num_seqs=1).generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].token_ids
             for p, sp in zip(PROMPTS, params)]
    llm = _llm(path, max_num_seqs=5, kv_cache_memory_bytes=14 * BLOCK_BYTES)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone


def test_prefix_cache_hits_counts_and_identity(tiny):
    path, hf = tiny
    llm = _llm(path, "ngram", max_num_seqs=4, enable_prefix_caching=True, check_state=True)
    first = SYSTEM + [8, 8]
    out = llm.generate({"prompt_token_ids": first}, _greedy(10), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(hf, first, 10)
    cache = llm.cache
    assert (cache.prefix_queries, cache.prefix_hits) == (len(first), 0)
    shared = {b: (cache.k[0][0, :, b * BLOCK : (b + 1) * BLOCK].clone(), cache.v[1][0, :, b * BLOCK : (b + 1) * BLOCK]
                  .clone()) for b in cache.pool.hash_of}
    # its 9 full prompt blocks, and as it finished the 3 more its answer filled: 39 + 10 - 1 = 48 positions computed
    assert len(shared) == 12, "the first request's full prompt and answer blocks are cached"
    prompts = [SYSTEM + t for t in TAILS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_greedy(12)] * 3, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 12), "a prefix hit changed the output"
    # each later prompt hits the 9 system blocks (36 tokens); its last token is always computed
    assert cache.prefix_queries == len(first) + sum(map(len, prompts))
    assert cache.prefix_hits == 3 * 36
    for b, (k, v) in shared.items():  # never written while shared (nor evicted: the pool is large)
        assert torch.equal(cache.k[0][0, :, b * BLOCK : (b + 1) * BLOCK], k), f"shared block {b} changed"
        assert torch.equal(cache.v[1][0, :, b * BLOCK : (b + 1) * BLOCK], v), f"shared block {b} changed"
    snap_engine = llm.engine
    assert snap_engine.kv_usage() == 0.0 and cache.pool.num_free == cache.pool.num_blocks
    cache.check()


def test_requests_sharing_a_prompt_that_arrive_together_compute_it_once(tiny):
    """Six requests with one system prompt, submitted at once with room for four: only the first prefills the nine
    shared blocks; the others wait for them to be cached instead of computing them again, then hit them."""
    path, hf = tiny
    llm = _llm(path, max_num_seqs=4, enable_prefix_caching=True, check_state=True)
    prompts = [SYSTEM + [i + 1, 2 * i + 1] for i in range(6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(6), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 6)
    assert llm.cache.prefix_queries == sum(map(len, prompts))
    assert llm.cache.prefix_hits == 5 * 36, "each later request hits the 9 system blocks"
    assert llm.engine.num_preemptions == 0


def test_reset_prefix_cache_makes_the_next_request_prefill_its_whole_prompt(tiny):
    """After `reset_prefix_cache` a prompt seen before hits nothing (as after a fresh start) and its output is the
    same; without the reset it hits its cached blocks."""
    path, hf = tiny
    llm = _llm(path, max_num_seqs=2, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": SYSTEM + [5, 6]}
    first = llm.generate([prompt], _greedy(4), use_tqdm=False)[0].token_ids
    hits = llm.cache.prefix_hits
    assert llm.generate([prompt], _greedy(4), use_tqdm=False)[0].token_ids == first
    assert llm.cache.prefix_hits > hits  # seen before: cached
    hits, queries = llm.cache.prefix_hits, llm.cache.prefix_queries
    llm.reset_prefix_cache()
    assert (llm.cache.prefix_hits, llm.cache.prefix_queries) == (hits, queries), "counters are lifetime totals"
    assert llm.generate([prompt], _greedy(4), use_tqdm=False)[0].token_ids == first
    assert llm.cache.prefix_hits == hits and llm.cache.prefix_queries == queries + len(SYSTEM) + 2
    assert first == hf_greedy(hf, SYSTEM + [5, 6], 4)


def test_reset_prefix_cache_reaches_the_llms_that_share_the_cache(tiny):
    """`with_speculation` LLMs share the KV cache: a reset through one is a reset for all (before, the one reset got
    a new cache and the other kept the old one with its cached prompts: two caches in memory), and it is refused
    while one of them holds blocks."""
    path, _ = tiny
    base = _llm(path, max_num_seqs=2, enable_prefix_caching=True)
    other = base.with_speculation({"method": "ngram", "num_speculative_tokens": 3})
    prompt = {"prompt_token_ids": SYSTEM + [5, 6]}
    first = other.generate([prompt], _greedy(4), use_tqdm=False)[0].token_ids
    assert other.cache is base.cache and base.cache.pool.cached
    base.reset_prefix_cache()
    assert other.cache is base.cache and not base.cache.pool.cached
    hits = other.cache.prefix_hits
    assert other.generate([prompt], _greedy(4), use_tqdm=False)[0].token_ids == first
    assert other.cache.prefix_hits == hits, "the sibling's prompt was still cached"
    eng = other.engine
    eng.add_request(Request(SYSTEM + [7], _greedy(8)))
    eng.step()  # admitted: its blocks are in the shared cache
    with pytest.raises(RuntimeError, match="in use"):
        base.reset_prefix_cache()
    while eng.has_work():
        eng.step()
    base.reset_prefix_cache()


def test_prefix_counters_reach_snapshot_and_metrics(tiny):
    from verispec.engine.background import BackgroundEngine
    from verispec.server.metrics import ServerMetrics

    path, _ = tiny
    llm = _llm(path, max_num_seqs=2, enable_prefix_caching=True)
    llm.generate([{"prompt_token_ids": SYSTEM + [1]}], _greedy(3), use_tqdm=False)
    llm.generate([{"prompt_token_ids": SYSTEM + [2, 3]}], _greedy(3), use_tqdm=False)
    bg = BackgroundEngine(llm.engine, llm.check_prompt_ids)  # not started: publishes the engine's state once
    snap = bg.snapshot()
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (38 + 39, 36)
    text = ServerMetrics(bg.snapshot).render()[0].decode()
    assert "verispec:prefix_cache_queries_total 77.0" in text
    assert "verispec:prefix_cache_hits_total 36.0" in text


def test_background_reset_refuses_while_requests_run_and_keeps_the_counters(tiny):
    """The server's reset runs on the worker's turn: refused (False, the cache unchanged) while a request holds
    blocks; done once none runs, before anything submitted meanwhile is admitted; the hit counters, published as
    Prometheus counters, never go back. The worker's turns are taken here by hand (not started)."""
    from verispec.engine.background import BackgroundEngine

    path, _ = tiny
    llm = _llm(path, max_num_seqs=2, enable_prefix_caching=True)
    llm.generate([{"prompt_token_ids": SYSTEM + [1]}], _greedy(3), use_tqdm=False)
    bg = BackgroundEngine(llm.engine, llm.check_prompt_ids)
    eng, cache = llm.engine, llm.cache
    stream = bg.submit(SYSTEM + [2], _greedy(6))
    bg._drain_inbox()
    eng.step()  # admitted, sharing the cached system blocks
    busy = bg.reset_prefix_cache()
    bg._drain_inbox()
    assert busy.result(0) is False and len(cache.match(SYSTEM + [3], len(SYSTEM))) == len(SYSTEM) // BLOCK
    while eng.has_work():
        eng.step()
    assert len(stream.output_ids) == 6
    totals = (cache.prefix_queries, cache.prefix_hits)
    done = bg.reset_prefix_cache()
    later = bg.submit(SYSTEM + [4], _greedy(2))  # submitted in the same turn: admitted after the reset
    bg._drain_inbox()
    assert done.result(0) is True and (cache.prefix_queries, cache.prefix_hits) == totals
    while eng.has_work():
        eng.step()
    assert len(later.output_ids) == 2 and cache.prefix_hits == totals[1], "the later request found nothing cached"
    bg._publish()
    assert bg.snapshot().prefix_cache_hits == totals[1]


def test_pool_sizing_and_requests_that_can_never_fit(tiny):
    from verispec.engine.core import RequestTooLong
    from verispec.state.request import Request

    path, _ = tiny
    assert _llm(path, max_num_seqs=3).cache.pool.num_blocks == 3 * 128 // BLOCK, "default: as many as 3 full slots"
    with pytest.raises(ValueError, match="holds no KV block"):
        _llm(path, kv_cache_memory_bytes=BLOCK_BYTES - 1)
    llm = _llm(path, kv_cache_memory_bytes=5 * BLOCK_BYTES)
    llm.engine.check_fits(Request([1] * 10, _greedy(10)))  # 20 positions: 5 blocks
    with pytest.raises(RequestTooLong, match="more KV blocks than the cache's 5"):
        llm.engine.check_fits(Request([1] * 10, _greedy(11)))


def test_queue_time_is_the_wait_for_a_batch_slot(tiny):
    """queue_s runs from submission to admission: with one slot the second request waits for the whole first one
    (its queue time covers the first's end-to-end time); with two slots neither waits past its first token."""
    path, _ = tiny
    p = [_greedy(12), _greedy(12)]
    a, b = _llm(path, max_num_seqs=1).generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                                               p, use_tqdm=False)
    assert 0 <= a.stats["queue_s"] < a.stats["ttft_s"] <= a.stats["e2e_s"]
    assert b.stats["queue_s"] >= a.stats["e2e_s"] - 0.01 and b.stats["queue_s"] < b.stats["ttft_s"]
    both = _llm(path, max_num_seqs=2).generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                                               p, use_tqdm=False)
    assert all(0 <= o.stats["queue_s"] < o.stats["ttft_s"] for o in both)
