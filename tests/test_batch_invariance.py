"""Batch-invariant attention (`LlamaModel.batch_invariant`): a query position's attention output is bitwise the
same whether it is computed alone (a plain decode step), as one row of a verify block of 8, or beside another
request's block in the same forward. This is what lets speculative greedy output equal plain output bitwise
on a path whose linears are row-wise invariant (tests/test_quantized.py checks that end to end)."""

from __future__ import annotations

import pytest
import torch

from verispec.models.llama import Segment
from verispec.models.loader import load_model

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=61, hidden_size=96, intermediate_size=128, num_attention_heads=6, num_key_value_heads=2,
              max_position_embeddings=128, initializer_range=0.1, num_hidden_layers=1)
CONTEXT, BLOCK = 37, 8


@pytest.fixture(scope="module", params=["llama", "mistral-window5"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    cfg = LlamaConfig(**COMMON) if request.param == "llama" else MistralConfig(**COMMON, sliding_window=5)
    torch.manual_seed(3)
    d = tmp_path_factory.mktemp(request.param)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    m, _ = load_model(str(d), dtype="float32", device="cpu", progress=False)
    m.batch_invariant = True
    return m


def _attend(model, q, k, v, segments, cache):
    """Layer 0's attention over `segments` (their blocks reserved here, rolled back after): [N, H hd]."""
    for s in segments:
        cache.reserve(s.slot, s.length)
    out = model.layers[0].attend(q, k, v, model._context(segments, cache))
    for s in segments:
        cache.rollback(s.slot, s.start)
    return out


def test_a_position_attends_the_same_alone_in_a_block_and_beside_another_request(model):
    torch.manual_seed(0)
    cfg = model.cfg
    H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cache = model.new_cache(64, num_slots=2)
    a, b = cache.allocate(), cache.allocate()
    for slot, n in ((a, CONTEXT), (b, 20)):
        model.prefill(torch.randint(0, cfg.vocab_size, (n,)).tolist(), cache, slot)
    q, k, v = torch.randn(BLOCK, H, hd), torch.randn(BLOCK, K, hd), torch.randn(BLOCK, K, hd)
    qb, kb, vb = torch.randn(3, H, hd), torch.randn(3, K, hd), torch.randn(3, K, hd)

    block = _attend(model, q, k, v, [Segment(a, CONTEXT, BLOCK)], cache)  # [BLOCK, H hd]
    beside = _attend(model, torch.cat([qb, q]), torch.cat([kb, k]), torch.cat([vb, v]),
                     [Segment(b, 20, 3), Segment(a, CONTEXT, BLOCK)], cache)[3:]
    alone = []
    for i in range(BLOCK):  # plain decoding: one position per step, each committed before the next
        alone.append(_attend(model, q[i : i + 1], k[i : i + 1], v[i : i + 1], [Segment(a, CONTEXT + i, 1)], cache))
        cache.reserve(a, 1)
        cache.write(0, a, CONTEXT + i, k[i : i + 1].transpose(0, 1), v[i : i + 1].transpose(0, 1))
        cache.commit(a, 1)
    alone = torch.cat(alone)
    assert torch.equal(block, alone), f"block vs alone: max |diff| {(block - alone).abs().max():.3g}"
    assert torch.equal(beside, alone), f"beside another request vs alone: max |diff| {(beside - alone).abs().max():.3g}"


def test_per_query_attention_equals_the_blocked_computation_up_to_rounding(model):
    """The invariant path computes the same attention as the default one (a causal, windowed softmax), only
    with each row's own key range: equal within fp32 rounding."""
    torch.manual_seed(1)
    cfg = model.cfg
    cache = model.new_cache(64)
    s = cache.allocate()
    model.prefill(torch.randint(0, cfg.vocab_size, (CONTEXT,)).tolist(), cache, s)
    q = torch.randn(BLOCK, cfg.num_heads, cfg.head_dim)
    k, v = torch.randn(BLOCK, cfg.num_kv_heads, cfg.head_dim), torch.randn(BLOCK, cfg.num_kv_heads, cfg.head_dim)
    seg = [Segment(s, CONTEXT, BLOCK)]
    invariant = _attend(model, q, k, v, seg, cache)
    model.batch_invariant = False
    try:
        default = _attend(model, q, k, v, seg, cache)
    finally:
        model.batch_invariant = True
    torch.testing.assert_close(invariant, default, atol=1e-5, rtol=1e-5)
