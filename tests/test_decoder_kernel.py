"""All decoder layers in one kernel call (models/decoder_kernel.py, csrc/cpu.c's `vs_decoder`) against the
layer-by-layer forward of the same model (models/llama.py's `Layer.forward` with the q8act linears, attention and
RoPE kernels, each tested against independent references in tests/test_q8act.py): bitwise equal logits, captured
hidden states and cache contents, on a tiny random model with GGUF blocks of every format, sliding-window and full
layers, GQA, several sequences per forward, a paged cache whose block tables are not consecutive and a slot cache;
and a float64 reference (dense dequantised weights, HF-style decoder written here) for the model alone. The default
model's own runs on the kernel are in tests/test_q8act.py (independent reference decoder, greedy spec == plain).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from verispec.kernels.cpu_kernels import KernelUnavailable, load

try:
    LIB = load()
except KernelUnavailable as e:
    pytest.skip(f"verispec's CPU kernel cannot be built here: {e}", allow_module_level=True)

from verispec.config import ModelConfig  # noqa: E402
from verispec.execution.features import take  # noqa: E402
from verispec.models.decoder_kernel import DecoderKernel  # noqa: E402
from verispec.kernels.q8act import Q8ActWeight  # noqa: E402
from verispec.models.llama import LlamaModel, Segment  # noqa: E402
from tests.test_q8act import dense, quantised, random_raw  # noqa: E402


@contextlib.contextmanager
def two_sequences(model: LlamaModel, paged: bool, use_kernel: bool, length: int, blocks: int,
                  block_size: int) -> Iterator[tuple[object, int, int]]:
    """A cache for two sequences (paged: `blocks` blocks of `block_size`; else two slots of `length`) and their
    slots, with the model on its one-call decoder (`use_kernel`) or layer by layer inside the block."""
    kernel = model.decoder_kernel
    model.decoder_kernel = kernel if use_kernel else None
    try:
        cache = model.new_paged_cache(length, blocks, block_size, 2) if paged else model.new_cache(length, 2)
        yield cache, cache.allocate(), cache.allocate()
    finally:
        model.decoder_kernel = kernel

@contextlib.contextmanager
def kv_dtype(model: LlamaModel, dtype: torch.dtype) -> Iterator[None]:
    """The model's caches in `dtype` inside the block (`LLM(kv_cache_dtype=...)`)."""
    old, model.kv_cache_dtype = model.kv_cache_dtype, dtype
    try:
        yield
    finally:
        model.kv_cache_dtype = old


# a float16 cache: the one-call decoder rounds K/V as it writes them (its own conversion) and reads them into float32,
# the layer-by-layer forward lets torch round them (`.to(float16)`) and reads them with `.to(float32)`
KV = pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["fp32kv", "fp16kv"])

CFG = ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, sliding_window=6,
                  sliding_layers=(True, False, True), max_position_embeddings=256, tie_word_embeddings=True)
KIND = {"qkv": "Q4_0", "o": "Q8_0", "gate_up": "Q4_1", "down": "Q4_0"}


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    torch.manual_seed(0)
    m = LlamaModel(CFG)
    with torch.no_grad():
        m.embed.normal_(0, 1)
        m.norm.uniform_(0.5, 1.5)
    for i, layer in enumerate(m.layers):
        with torch.no_grad():
            layer.attn_norm.uniform_(0.5, 1.5)
            layer.mlp_norm.uniform_(0.5, 1.5)
        for j, (name, kind) in enumerate(KIND.items()):
            n, k = getattr(layer, name).shape
            delattr(layer, name)
            setattr(layer, name, Q8ActWeight(random_raw(kind, n, k, seed=10 * i + j), kind, n, k))
    m.attention_kernel, m.rope_kernel, m.batch_invariant = LIB.attention, LIB.rope, True
    m.decoder_kernel = DecoderKernel.build(m)
    assert m.decoder_kernel is not None
    return m


def steps(model: LlamaModel, paged: bool, use_kernel: bool) -> tuple[list[torch.Tensor], object]:
    """Two prompts (13 and 7 tokens), then forwards of both sequences together (3 + 1, 1 + 2, 1 + 1 tokens), each
    committed but for one rejected row; every row's logits, two layers' inputs; the cache at the end."""
    with two_sequences(model, paged, use_kernel, 64, 24, 4) as (cache, a, b):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, CFG.vocab_size, (40,), generator=g)
        outs = []
        for slot, toks in ((a, ids[:13]), (b, ids[13:20])):
            o = model.prefill(toks, cache, slot, logits_indices=range(len(toks)), capture_layers=(1, 3))
            # the features a drafter reads: one slice of the kernel's side-by-side buffer, else the concatenation
            assert (o.packed is not None) == use_kernel
            outs += [o.logits, o.hidden[1], o.hidden[3], take(o, (1, 3), slice(2, len(toks)))]
        at = 20
        for na, nb in ((3, 1), (1, 2), (1, 1)):
            segs = [Segment(a, cache.length(a), na), Segment(b, cache.length(b), nb)]
            o = model(ids[at : at + na + nb], segs, cache, logits_indices=range(na + nb), capture_layers=(0, 2))
            outs += [o.logits, o.hidden[0], o.hidden[2], take(o, (0, 2), torch.tensor([na + nb - 1, 0]))]
            at += na + nb
            cache.commit(a, max(1, na - 1))  # the last drafted row of a rejected
            cache.commit(b, nb)
        return outs, cache


@KV
@pytest.mark.parametrize("paged", [True, False])
def test_one_call_equals_the_layer_by_layer_forward_bitwise(model: LlamaModel, paged: bool, kv: torch.dtype) -> None:
    with kv_dtype(model, kv):
        ours, cache = steps(model, paged, True)
        ref, ref_cache = steps(model, paged, False)
    assert cache.k[0].dtype is ref_cache.k[0].dtype is kv
    for i, (x, y) in enumerate(zip(ours, ref)):
        assert torch.equal(x, y), (i, (x - y).abs().max())
    for x, y in zip(ours_kv(cache), ours_kv(ref_cache)):  # the same K/V at the same places
        assert torch.equal(x, y)
    if paged:  # the sequences' blocks interleave: b's table is not one run, so the addressing was exercised
        assert any(t[j + 1] != t[j] + 1 for t in (cache.table(0), cache.table(1)) for j in range(len(t) - 1))


def ours_kv(cache) -> list[torch.Tensor]:
    return [cache.read(i, s, cache.length(s))[j] for i in range(CFG.num_layers) for s in (0, 1) for j in (0, 1)]


def test_a_row_alone_equals_the_row_beside_others(model: LlamaModel) -> None:
    """Batch invariance: the last prompt token's logits alone, in a block of 5 and beside another sequence."""
    ids = torch.arange(30) * 7 % CFG.vocab_size
    cache = model.new_paged_cache(64, 24, 4, 2)
    a, b = cache.allocate(), cache.allocate()
    model.prefill(ids[:9], cache, a)
    alone = model(ids[9:10], [Segment(a, 9, 1)], cache).logits
    cache.rollback(a, 9)
    block = model(ids[9:14], [Segment(a, 9, 5)], cache, logits_indices=[0]).logits
    cache.rollback(a, 9)
    model.prefill(ids[14:25], cache, b)
    beside = model(torch.cat([ids[25:27], ids[9:10]]), [Segment(b, 11, 2), Segment(a, 9, 1)], cache,
                   logits_indices=[2]).logits
    assert torch.equal(alone, block) and torch.equal(alone, beside)


def test_matches_a_float64_decoder_written_here(model: LlamaModel) -> None:
    """The kernel's prompt logits against dense dequantised weights times the quantised activations in float64,
    HF's decoder arithmetic (RMSNorm, rotate-half RoPE, GQA, a causal window of 6 in layers 0 and 2, SwiGLU)."""
    ids = torch.arange(17) * 5 % CFG.vocab_size
    cache = model.new_cache(32)
    got = model.prefill(ids, cache, cache.allocate(), logits_indices=range(17)).logits.double()
    want = reference_logits(model, ids)
    scale = want.abs().max()
    assert (got - want).abs().max() < 1e-3 * scale, (got - want).abs().max() / scale


def reference_logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    c = CFG
    H, K, hd, n = c.num_heads, c.num_kv_heads, c.head_dim, len(ids)

    def lin(w: Q8ActWeight, x: torch.Tensor) -> torch.Tensor:  # the kernel's rule: int8 activations per 32
        return quantised(x.float()) @ DENSE[id(w)].T

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w.double()

    pos = torch.arange(n, dtype=torch.float64)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.cat([pos[:, None] * inv] * 2, -1)  # [n, hd]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def rope(t: torch.Tensor) -> torch.Tensor:
        half = torch.cat([-t[..., hd // 2 :], t[..., : hd // 2]], -1)
        return t * cos + half * sin

    x = model.embed.detach().double()[ids]
    for i, layer in enumerate(model.layers):
        qkv = lin(layer.qkv, norm(x, layer.attn_norm))
        q, k, v = qkv.split([H * hd, K * hd, K * hd], -1)
        q, k, v = rope(q.view(n, H, hd)), rope(k.view(n, K, hd)), v.view(n, K, hd)
        k, v = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        qi, ki = torch.arange(n)[:, None], torch.arange(n)[None]
        hidden = ki > qi
        if c.layer_window(i):
            hidden |= ki <= qi - c.layer_window(i)
        att = torch.einsum("hqk,khd->qhd", s.masked_fill(hidden, float("-inf")).softmax(-1), v).reshape(n, H * hd)
        x = x + lin(layer.o, att)
        gu = lin(layer.gate_up, norm(x, layer.mlp_norm))
        g, u = gu.chunk(2, -1)
        x = x + lin(layer.down, torch.nn.functional.silu(g) * u)
    return norm(x, model.norm) @ model.embed.detach().double().T


DENSE: dict[int, torch.Tensor] = {}


@pytest.fixture(scope="module", autouse=True)
def _dense_weights(model: LlamaModel) -> None:
    """gguf's dequantisation of each random weight (its raw blocks rebuilt from the same seeds)."""
    for i, layer in enumerate(model.layers):
        for j, (name, kind) in enumerate(KIND.items()):
            w = getattr(layer, name)
            DENSE[id(w)] = dense(random_raw(kind, w.n, w.k, seed=10 * i + j), kind, w.n, w.k)


TREE = (-1, -1, 0, 0, 1, 3)  # two children of the root, two under the first, one under the second, one deeper


def tree_steps(model: LlamaModel, paged: bool, use_kernel: bool) -> list[torch.Tensor]:
    """A prompt per sequence, then one forward of a draft tree (7 rows) for sequence a beside a chain of 2 for b,
    and one of a tree for b alone: every row's logits and layer 1's input."""
    with two_sequences(model, paged, use_kernel, 64, 24, 4) as (cache, a, b):
        ids = torch.arange(40) * 11 % CFG.vocab_size
        model.prefill(ids[:13], cache, a)
        model.prefill(ids[13:22], cache, b)
        segs = [Segment(a, 13, 7, tree=TREE), Segment(b, 9, 2)]
        o1 = model(ids[22:31], segs, cache, logits_indices=range(9), capture_layers=(1,))
        cache.commit_rows(a, [0, 1, 3])  # the root and an accepted path
        cache.commit(b, 2)
        o2 = model(ids[31:38], [Segment(b, 11, 7, tree=TREE)], cache, logits_indices=range(7), capture_layers=(1,))
        return [o1.logits, o1.hidden[1], o2.logits, o2.hidden[1]]


@KV
@pytest.mark.parametrize("paged", [True, False])
def test_draft_trees_in_one_call_equal_the_layer_by_layer_forward_bitwise(model: LlamaModel, paged: bool,
                                                                          kv: torch.dtype) -> None:
    """Tree rows attend to the context (inside the window of their RoPE position), their ancestors and themselves."""
    with kv_dtype(model, kv):
        assert model.decoder_kernel.covers([Segment(0, 0, 7, tree=TREE)], model.new_cache(16))
        for i, (x, y) in enumerate(zip(tree_steps(model, paged, True), tree_steps(model, paged, False))):
            assert torch.equal(x, y), (i, (x - y).abs().max())


def long_steps(model: LlamaModel, paged: bool, use_kernel: bool) -> list[torch.Tensor]:
    """Longer contexts (45 and 30 prompt tokens): a chain of 9 rows beside a tree, then a chain of 5 beside a chain
    of 3: in the one-call decoder a sequence's rows are attended together over their shared keys, several query
    heads per key read, in runs of 16 (paged) or one run (slot cache); every row's logits and layer 2's input."""
    with two_sequences(model, paged, use_kernel, 128, 20, 16) as (cache, a, b):
        ids = torch.arange(120) * 13 % CFG.vocab_size
        outs = [model.prefill(ids[:45], cache, a, logits_indices=range(45)).logits,
                model.prefill(ids[45:75], cache, b, logits_indices=range(30)).logits]
        o = model(ids[75:91], [Segment(a, 45, 9), Segment(b, 30, 7, tree=TREE)], cache, logits_indices=range(16),
                  capture_layers=(2,))
        outs += [o.logits, o.hidden[2]]
        cache.commit(a, 7)
        cache.commit_rows(b, [0, 1, 3])
        o = model(ids[91:99], [Segment(b, 33, 3), Segment(a, 52, 5)], cache, logits_indices=range(8))
        return outs + [o.logits]


@KV
@pytest.mark.parametrize("paged", [True, False])
def test_rows_attended_together_over_long_contexts_equal_the_layer_by_layer_forward(model: LlamaModel, paged: bool,
                                                                                    kv: torch.dtype) -> None:
    with kv_dtype(model, kv):
        for i, (x, y) in enumerate(zip(long_steps(model, paged, True), long_steps(model, paged, False))):
            assert torch.equal(x, y), (i, (x - y).abs().max())


def test_a_float16_cache_changes_the_logits_as_rounding_k_and_v_does_and_no_more(model: LlamaModel) -> None:
    """Against a float32 cache the float16 one moves the logits (its K/V are rounded), but only by what rounding
    K/V to 11 significant bits can: far less than the logits' own spread."""
    full = long_steps(model, True, True)
    with kv_dtype(model, torch.float16):
        half = long_steps(model, True, True)
    moved = max((x - y).abs().max().item() for x, y in zip(full, half))
    spread = max(x.abs().max().item() for x in full)
    assert 0 < moved < 1e-2 * spread, (moved, spread)


@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
def test_the_kernel_rounds_to_float16_as_torch_does(portable: bool) -> None:
    """The conversion a float16 cache's writes use, against torch's `.to(float16)` bit for bit: ties to even,
    subnormal halves, the largest half, overflow to inf, signed zeros, across the whole float range."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(4000, generator=g) * 10.0 ** torch.randint(-9, 6, (4000,), generator=g),
                   torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, float("inf"), float("-inf"),
                                 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-26, 1 + 2.0**-11, 1 + 3 * 2.0**-11,
                                 5.9604645e-08, 6.1035156e-05, 6.097555e-05, 1e-40])])
    got = torch.empty(x.numel(), dtype=torch.int16)
    assert LIB.lib.vs_to_f16(x.data_ptr(), x.numel(), got.data_ptr(), int(portable)) == 0
    want = x.to(torch.float16).view(torch.int16)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), int(got[i]), int(want[i])) for i in bad[:5]]


def test_how_many_rows_share_a_key_read_changes_no_bit(model: LlamaModel) -> None:
    """Rows one at a time, in pairs, in fives, or as many as a task holds (the default): the same bits, in every
    row of the long steps, paged."""
    from verispec.kernels.cpu_kernels import load

    default = long_steps(model, True, True)
    for rows in (1, 2, 5):
        with load().attending_rows(rows):
            for i, (x, y) in enumerate(zip(long_steps(model, True, True), default)):
                assert torch.equal(x, y), (rows, i, (x - y).abs().max())


def test_what_the_call_does_not_cover_goes_layer_by_layer(model: LlamaModel) -> None:
    kernel = model.decoder_kernel
    cache = model.new_cache(128)
    assert kernel.covers([Segment(0, 0, 4)], cache)
    assert not kernel.covers([Segment(0, 0, 65, tree=(-1,) * 64)], cache)  # past a 64-bit row mask
    assert not kernel.covers([Segment(0, 0, 8, tree=tuple(range(-1, 6)))], cache)  # depth 7: past the window of 6
    bf16 = model.new_cache(32)
    bf16.k = [t.bfloat16() for t in bf16.k]
    assert not kernel.covers([Segment(0, 0, 4)], bf16)
    with kv_dtype(model, torch.float16):
        assert kernel.covers([Segment(0, 0, 4)], model.new_cache(32))
