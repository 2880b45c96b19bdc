"""Batch-invariant attention (`LlamaModel.batch_invariant`): a query position's attention output is bitwise the
same whether it is computed alone (a plain decode step), as one row of a verify block of 8, or beside other
requests in the same forward. This is what lets speculative greedy output equal plain output bitwise on a path
whose linears are row-wise invariant (tests/test_quantized.py checks that end to end).

The per-query path pads each row's key range to a length bucket of its own position and batches rows of one bucket
(models/attention.py); the rows' keys come from a cache view, a view shared by a block's rows, or a gather. The
tests below drive every one of those, and the default path's batched groups (several decode or verify segments in
one call), against a float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from verispec.models.attention import BATCH_MAX_LEN, bucket
from verispec.models.llama import Segment
from verispec.models.loader import load_model

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=61, hidden_size=96, intermediate_size=128, max_position_embeddings=128,
              initializer_range=0.1, num_hidden_layers=1)
HEADS = dict(num_attention_heads=6, num_key_value_heads=2)  # head_dim 16: 1/sqrt(hd) a power of two
CONTEXT, BLOCK = 37, 8


@pytest.fixture(scope="module", params=["llama", "mistral-window5", "llama-hd32"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    if request.param == "llama":
        cfg = LlamaConfig(**COMMON, **HEADS)
    elif request.param == "mistral-window5":
        cfg = MistralConfig(**COMMON, **HEADS, sliding_window=5)
    else:  # head_dim 32: the scale 1/sqrt(32) is not a power of two (scores scaled after the matmul)
        cfg = LlamaConfig(**COMMON, num_attention_heads=3, num_key_value_heads=1)
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


def _qkv(cfg, n):
    return (torch.randn(n, cfg.num_heads, cfg.head_dim), torch.randn(n, cfg.num_kv_heads, cfg.head_dim),
            torch.randn(n, cfg.num_kv_heads, cfg.head_dim))


def _filled_cache(model, lengths, max_len=64, num_slots=None):
    """A cache whose slots i hold lengths[i] committed positions of random K/V (None: slot left free)."""
    cfg = model.cfg
    cache = model.new_cache(max_len, num_slots=num_slots or len(lengths))
    for n in lengths:
        slot = cache.allocate()
        if n is None:
            continue
        for t in (cache.k[0], cache.v[0]):
            t[slot, :, :n] = torch.randn(cfg.num_kv_heads, n, cfg.head_dim)
        cache.reserve(slot, n)
        cache.commit(slot, n)
    return cache


def _reference(model, q, k, v, segments, cache):
    """float64 attention of each row over the keys its position sees (the block's own K/V written first)."""
    cfg, layer = model.cfg, model.layers[0]
    H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out, off = [], 0
    for s in segments:
        keys, vals = (t.double() for t in cache.read(0, s.slot, s.start))  # [K, start, hd] each
        keys = torch.cat([keys, k[off : off + s.length].transpose(0, 1).double()], dim=1)
        vals = torch.cat([vals, v[off : off + s.length].transpose(0, 1).double()], dim=1)
        for i in range(s.length):
            p = s.start + i
            lo = 0 if layer.window is None else max(0, p - layer.window + 1)
            qi = q[off + i].double().view(K, H // K, hd)
            w = torch.softmax(qi @ keys[:, lo : p + 1].transpose(1, 2) / hd**0.5, dim=-1)  # [K, G, L]
            out.append((w @ vals[:, lo : p + 1]).reshape(1, H * hd))
        off += s.length
    return torch.cat(out).float()


def test_a_position_attends_the_same_alone_in_a_block_and_beside_another_request(model):
    torch.manual_seed(0)
    cfg = model.cfg
    cache = _filled_cache(model, [CONTEXT, 20])
    a, b = 0, 1
    q, k, v = _qkv(cfg, BLOCK)
    qb, kb, vb = _qkv(cfg, 3)

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


def test_decode_rows_of_many_requests_attend_as_if_alone(model):
    """Many one-token segments in one forward: rows of one bucket share a batched call, their keys a view
    (consecutive slots) or a gather (slots 0, 2, 5, ...; some past the cache's end, clamped and masked)."""
    torch.manual_seed(4)
    cfg = model.cfg
    lengths = [30, 31, 33, 20, 47, 55, 34, 41]  # 55: its bucket (64) reaches past the cache's 60 positions
    cache = _filled_cache(model, lengths, max_len=60)
    order = [0, 1, 6, 2, 3, 4, 5, 7]  # slots 0, 1 consecutive; then scattered
    q, k, v = _qkv(cfg, len(order))
    segments = [Segment(s, lengths[s], 1) for s in order]
    together = _attend(model, q, k, v, segments, cache)
    for i, s in enumerate(segments):
        alone = _attend(model, q[i : i + 1], k[i : i + 1], v[i : i + 1], [s], cache)
        assert torch.equal(together[i : i + 1], alone), f"row {i} (slot {s.slot}) differs from its lone step"
    consecutive = _attend(model, q[:2], k[:2], v[:2], segments[:2], cache)  # slots 0, 1: one view
    assert torch.equal(consecutive, together[:2])
    torch.testing.assert_close(together, _reference(model, q, k, v, segments, cache), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["reversed-decode", "blocks-and-decode"])
def test_rows_of_many_requests_in_any_slot_order_attend_as_if_alone(model, case):
    """Rows regrouped by slot: decode rows of consecutive slots in reverse order run as one view; verify blocks of
    several requests each on a shared view of their slot, the remaining rows gathered."""
    torch.manual_seed(6)
    cfg = model.cfg
    if case == "reversed-decode":
        lengths = [40 + i for i in range(8)]  # one bucket (48)
        segments = [Segment(s, lengths[s], 1) for s in reversed(range(8))]
    else:
        lengths = [30, 31, 33, 34, 20, 40]
        segments = [Segment(3, 34, 1), Segment(1, 31, 6), Segment(2, 33, 1), Segment(0, 30, 1), Segment(5, 40, 5),
                    Segment(4, 20, 1)]
    cache = _filled_cache(model, lengths)
    q, k, v = _qkv(cfg, sum(s.length for s in segments))
    together, off = _attend(model, q, k, v, segments, cache), 0
    for s in segments:
        rows = slice(off, off + s.length)
        alone = _attend(model, q[rows], k[rows], v[rows], [s], cache)
        assert torch.equal(together[rows], alone), f"slot {s.slot}: rows differ from their segment alone"
        off += s.length
    torch.testing.assert_close(together, _reference(model, q, k, v, segments, cache), atol=1e-5, rtol=1e-5)


def test_a_huge_group_split_into_several_calls_computes_the_same(model, monkeypatch):
    """Groups past GROUP_ELEMENTS run as several calls (bounded memory for long prefills); rows do not notice."""
    import verispec.models.attention as attention

    torch.manual_seed(5)
    cfg = model.cfg
    cache = _filled_cache(model, [CONTEXT, 20, 33])
    q, k, v = _qkv(cfg, 2 * BLOCK + 1)
    segments = [Segment(0, CONTEXT, BLOCK), Segment(1, 20, 1), Segment(2, 33, BLOCK)]
    whole = _attend(model, q, k, v, segments, cache)
    monkeypatch.setattr(attention, "GROUP_ELEMENTS", 1)  # one entry per call
    assert torch.equal(_attend(model, q, k, v, segments, cache), whole)
    model.batch_invariant = False
    try:
        split = _attend(model, q, k, v, segments, cache)
        monkeypatch.setattr(attention, "GROUP_ELEMENTS", 1 << 24)
        torch.testing.assert_close(split, _attend(model, q, k, v, segments, cache), atol=1e-5, rtol=1e-5)
    finally:
        model.batch_invariant = True


def test_the_padded_key_length_depends_only_on_the_position():
    assert [bucket(n) for n in (1, 16, 17, 127, 128, 129, 200, 256, 257, 1000)] == \
        [16, 16, 32, 128, 128, 144, 208, 256, 288, 1024]
    assert all(n <= bucket(n) <= max(n + 15, n * 9 // 8) for n in range(1, 5000))


def test_per_query_attention_equals_the_blocked_computation_up_to_rounding(model):
    """The invariant path computes the same attention as the default one (a causal, windowed softmax), only
    with each row's own key range: equal within fp32 rounding."""
    torch.manual_seed(1)
    cfg = model.cfg
    cache = _filled_cache(model, [CONTEXT])
    q, k, v = _qkv(cfg, BLOCK)
    seg = [Segment(0, CONTEXT, BLOCK)]
    invariant = _attend(model, q, k, v, seg, cache)
    model.batch_invariant = False
    try:
        default = _attend(model, q, k, v, seg, cache)
    finally:
        model.batch_invariant = True
    torch.testing.assert_close(invariant, default, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(invariant, _reference(model, q, k, v, seg, cache), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths, slots", [((1, 1, 1, 1), (0, 1, 2, 3)), ((4, 4, 4), (0, 2, 1)),
                                           ((1, 3, 1, BATCH_MAX_LEN + 1, 3), (0, 2, 4, 1, 3))])
@pytest.mark.parametrize("pad_keys", [512, 20])  # 20: padding over 20 key rows splits a group by key count
def test_default_path_batches_segments_into_the_same_attention(model, lengths, slots, pad_keys, monkeypatch):
    """Default path: segments of one short length share one batched call (key ranges padded and masked; a view of
    consecutive slots, else a gather), longer or lone segments attend alone: each row equals its lone segment's result
    within fp32 rounding, and the float64 reference."""
    import verispec.models.attention as attention

    monkeypatch.setattr(attention, "PAD_KEYS", pad_keys)
    torch.manual_seed(2)
    cfg = model.cfg
    starts = [30, 9, 44, 12, 25]  # slots 0, 1, 2 consecutive, then 3, 4
    cache = _filled_cache(model, starts[: len(lengths)], max_len=80)
    segments = [Segment(i, starts[i], lengths[i]) for i in slots]  # slots out of order: rows regrouped, put back
    q, k, v = _qkv(cfg, sum(lengths))
    model.batch_invariant = False
    try:
        together = _attend(model, q, k, v, segments, cache)
        off, alone = 0, []
        for s in segments:
            rows = slice(off, off + s.length)
            alone.append(_attend(model, q[rows], k[rows], v[rows], [s], cache))
            off += s.length
    finally:
        model.batch_invariant = True
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together, _reference(model, q, k, v, segments, cache), atol=1e-5, rtol=1e-5)


def _filled_paged(model, lengths, block_size=4):
    """A paged cache whose sequence i holds lengths[i] committed positions of random K/V: sequence 0 in
    consecutive blocks (a view), the others filled round-robin a block at a time (scattered tables: gathers)."""
    cfg = model.cfg
    cache = model.new_paged_cache(64, num_blocks=sum(-(-n // block_size) + 1 for n in lengths) + 8,
                                  block_size=block_size, num_slots=len(lengths))
    slots = [cache.allocate() for _ in lengths]

    def fill(slot, n):
        start = cache.reserve(slot, n)
        cache.write(0, slot, start, torch.randn(cfg.num_kv_heads, n, cfg.head_dim),
                    torch.randn(cfg.num_kv_heads, n, cfg.head_dim))
        cache.commit(slot, n)

    fill(slots[0], lengths[0])
    while any(cache.length(s) < n for s, n in zip(slots[1:], lengths[1:])):
        for s, n in zip(slots[1:], lengths[1:]):
            if cache.length(s) < n:
                fill(s, min(block_size, n - cache.length(s)))
    cache.check()
    return cache


def test_paged_cache_rows_attend_as_if_alone_and_as_the_reference(model):
    """The paged cache: decode rows and verify blocks of sequences in consecutive or scattered blocks, in one
    forward, are bitwise what each computes alone, and match float64 attention over their keys."""
    torch.manual_seed(8)
    cfg = model.cfg
    lengths = [37, 30, 33, 20, 41, 9]
    cache = _filled_paged(model, lengths)
    assert cache.table(0) == list(range(len(cache.table(0)))), "a lone sequence's blocks are consecutive"
    assert any(t[i + 1] != t[i] + 1 for t in map(cache.table, range(1, 6)) for i in range(len(t) - 1))
    segments = [Segment(3, 20, 1), Segment(1, 30, 6), Segment(0, 37, 1), Segment(2, 33, 1), Segment(4, 41, 5),
                Segment(5, 9, 1)]
    q, k, v = _qkv(cfg, sum(s.length for s in segments))
    together, off = _attend(model, q, k, v, segments, cache), 0
    for s in segments:
        rows = slice(off, off + s.length)
        alone = _attend(model, q[rows], k[rows], v[rows], [s], cache)
        assert torch.equal(together[rows], alone), f"sequence {s.slot}: rows differ from their segment alone"
        off += s.length
    torch.testing.assert_close(together, _reference(model, q, k, v, segments, cache), atol=1e-5, rtol=1e-5)
    cache.check()
