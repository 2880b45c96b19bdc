"""Property tests of the KV cache's block protocol (reserve -> forward -> commit / rollback) against HF.

Random sequences of "append a block, keep c of it" and "roll back to length L" run through our decoder and
its cache; after every forward, the logits of the block's positions must equal HF transformers' forward over
the sequence the test expects to be committed plus that block, recomputed from scratch. This shows that
rejected or rolled-back positions are invisible and that positions stay in step, for full attention, a
sliding window on every layer (Mistral) and a mix of full and windowed layers (Qwen2 max_window_layers).
Tests 1 and 2 run on the slot cache and on the paged cache (blocks of 4 in a fragmented pool, so sequences read
runs of consecutive blocks as views and the rest through their block tables), whose invariants are checked after
every operation.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verispec.state.kv_cache import CacheFullError, KVCache
from verispec.models.llama import Segment
from verispec.models.loader import load_model

transformers = pytest.importorskip("transformers")

VOCAB = 61
MAX_LEN = 64
TOL = 1e-4
# tiny: every forward (ours and HF's) takes about a millisecond, so hypothesis can run many operations
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, initializer_range=0.1)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
tokens = st.integers(0, VOCAB - 1)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama": LlamaConfig(**COMMON, num_hidden_layers=2),
        "mistral-window4": MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=4),
        # layer 0 full attention, layers 1 and 2 a window of 3
        "qwen2-window3": Qwen2Config(**COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=3,
                                     max_window_layers=1),
    }


NAMES = list(_configs())


class Oracle:
    """HF's logits over a whole token sequence, from scratch (no cache), memoised by the sequence."""

    def __init__(self, hf) -> None:
        self.hf = hf
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, seq: list[int]) -> torch.Tensor:
        key = tuple(seq)
        if key not in self.memo:
            with torch.no_grad():
                self.memo[key] = self.hf(torch.tensor([seq])).logits[0].float()
        return self.memo[key]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, cfg) in enumerate(_configs().items()):
        torch.manual_seed(100 + i)
        cfg._attn_implementation = "eager"
        hf = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():  # random norms too, so that they matter
            for pname, p in hf.named_parameters():
                if "norm" in pname or "bias" in pname:
                    p.add_(torch.randn_like(p) * 0.1)
        d = tmp_path_factory.mktemp(name)
        hf.save_pretrained(d)
        ours, _ = load_model(str(d), dtype="float32")
        out[name] = (ours, Oracle(hf))
    cfg = out["qwen2-window3"][0].cfg
    assert [cfg.layer_window(i) for i in range(3)] == [None, 3, 3]
    assert out["mistral-window4"][0].cfg.sliding_layers == (True, True)
    # Tensors this small gain nothing from threads, and OpenMP workers spinning for a busy core make every op
    # hundreds of times slower on a loaded machine: one thread while this module runs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield out
    torch.set_num_threads(threads)


BLOCK = 4  # the paged cache's block size here
KINDS = ["slot", "paged"]


def _new_cache(ours, kind: str, num_slots: int = 1):
    """A slot cache, or a paged cache whose free blocks come in runs of 3 or 4 (a spacer sequence holds every
    block b with b % 5 == 3), so block tables mix consecutive and scattered blocks."""
    if kind == "slot":
        return ours.new_cache(MAX_LEN, num_slots=num_slots)
    total = num_slots * (MAX_LEN // BLOCK) * 5 // 4 + 8
    cache = ours.new_paged_cache(MAX_LEN, num_blocks=total, block_size=BLOCK, num_slots=num_slots + 1)
    spacer = cache.allocate()
    taken = [cache.pool.take() for _ in range(total)]
    for b in taken:
        if b % 5 != 3:
            cache.pool.release(b)
    s = cache.slots[spacer]
    s.blocks = [b for b in taken if b % 5 == 3]
    s.length = len(s.blocks) * BLOCK
    cache.check()
    return cache


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _forward_blocks(ours, cache, blocks: list[tuple[int, list[int]]]):
    """One forward over the blocks of several slots (in this order); returns each block's logits [b, V]."""
    segs = [Segment(slot, cache.length(slot), len(block)) for slot, block in blocks]
    ids = torch.tensor([t for _, block in blocks for t in block], dtype=torch.long)
    out = ours(ids, segs, cache, logits_indices=range(len(ids)))
    res, off = [], 0
    for _, block in blocks:
        res.append(out.logits[off : off + len(block)])
        off += len(block)
    return res


def _check(got: torch.Tensor, oracle: Oracle, committed: list[int], block: list[int], what: str) -> None:
    ref = oracle(committed + block)[len(committed) :]
    d = _max_diff(got, ref)
    assert d <= TOL, f"{what}: block {block} after committed {committed}: max |diff| {d:.3g}"


def _resolve(data, cache: KVCache, slot: int, expected: list[int], block: list[int], label: str) -> None:
    """Close the open block: keep its first c positions, or (sometimes) roll back to a length <= committed."""
    if data.draw(st.integers(0, 4), label=f"{label} resolve") > 0:
        c = data.draw(st.integers(0, len(block)), label=f"{label} commit c")
        cache.commit(slot, c)
        expected.extend(block[:c])
    else:  # rollback also discards the pending block
        n = data.draw(st.integers(0, len(expected)), label=f"{label} rollback-with-pending to")
        cache.rollback(slot, n)
        del expected[n:]
    assert cache.length(slot) == len(expected)
    assert cache.slots[slot].pending == 0
    if hasattr(cache, "check"):
        cache.check()


# ---- 1. one slot: random appends / partial commits / rollbacks ------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data())
def test_single_slot_operations_match_hf(models, name, kind, data):
    ours, oracle = models[name]
    cache = _new_cache(ours, kind)
    slot = cache.allocate()
    expected: list[int] = []
    n_ops = data.draw(st.integers(1, 14), label="n_ops")
    for step in range(n_ops + 1):
        room = MAX_LEN - len(expected)
        last = step == n_ops  # a final append probes the state the last operation left behind
        if not last and (room == 0 or data.draw(st.integers(0, 2), label="op") == 0):
            n = data.draw(st.integers(0, len(expected)), label="rollback to")
            cache.rollback(slot, n)
            del expected[n:]
            assert cache.length(slot) == n
            continue
        if room == 0:
            break
        b = data.draw(st.integers(1, min(6, room)), label="b")
        block = data.draw(st.lists(tokens, min_size=b, max_size=b), label="block")
        (got,) = _forward_blocks(ours, cache, [(slot, block)])
        _check(got, oracle, expected, block, f"{name} step {step}")
        _resolve(data, cache, slot, expected, block, "slot")


def test_single_slot_fills_to_max_len(models):
    """Up to the last position, and one more raises CacheFullError without touching the slot."""
    ours, oracle = models["mistral-window4"]
    cache = ours.new_cache(16)
    slot = cache.allocate()
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, VOCAB, (16,), generator=g).tolist()
    expected: list[int] = []
    for b in (5, 6, 5):
        block = seq[len(expected) : len(expected) + b]
        (got,) = _forward_blocks(ours, cache, [(slot, block)])
        _check(got, oracle, expected, block, "fill")
        cache.commit(slot, b)
        expected += block
    assert cache.length(slot) == 16
    with pytest.raises(CacheFullError, match="max_model_len"):
        _forward_blocks(ours, cache, [(slot, [1])])
    assert cache.length(slot) == 16 and cache.slots[slot].pending == 0
    cache.rollback(slot, 13)  # make room again: the next block must follow position 12
    del expected[13:]
    (got,) = _forward_blocks(ours, cache, [(slot, [7, 8, 9])])
    _check(got, oracle, expected, [7, 8, 9], "after full")


# ---- 2. two slots, interleaved, sometimes in one forward -------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data())
def test_two_slots_interleaved_match_hf(models, name, kind, data):
    ours, oracle = models[name]
    cache = _new_cache(ours, kind, num_slots=2)
    slots = [cache.allocate(), cache.allocate()]
    expected: dict[int, list[int]] = {s: [] for s in slots}
    n_ops = data.draw(st.integers(1, 14), label="n_ops")
    for step in range(n_ops + 1):
        last = step == n_ops
        op = "append" if last else data.draw(st.sampled_from(["append"] * 4 + ["rollback", "free"]), label="op")
        if op == "rollback":
            s = data.draw(st.sampled_from(slots), label="rollback slot")
            n = data.draw(st.integers(0, len(expected[s])), label="rollback to")
            cache.rollback(s, n)
            del expected[s][n:]
            continue
        if op == "free":  # the sequence ends; a new one gets the same slot and must not see its old K/V
            s = data.draw(st.sampled_from(slots), label="free slot")
            cache.free(s)
            assert cache.allocate() == s
            assert cache.length(s) == 0
            expected[s] = []
            continue
        order = [0, 1] if last else data.draw(st.sampled_from([[0], [1], [0, 1], [1, 0]]), label="slots")
        blocks = []
        for s in (slots[i] for i in order):
            room = MAX_LEN - len(expected[s])
            if room == 0:
                continue
            b = data.draw(st.integers(1, min(6, room)), label=f"b{s}")
            blocks.append((s, data.draw(st.lists(tokens, min_size=b, max_size=b), label=f"block{s}")))
        if not blocks:
            continue
        outs = _forward_blocks(ours, cache, blocks)
        for (s, block), got in zip(blocks, outs):
            _check(got, oracle, expected[s], block, f"{name} step {step} slot {s} of {len(blocks)}")
        for s, block in blocks:
            _resolve(data, cache, s, expected[s], block, f"slot{s}")


# ---- 3. negative control: stale state must be caught -----------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=20, deadline=None)
@given(
    prefix=st.lists(tokens, min_size=1, max_size=10),
    block=st.lists(tokens, min_size=2, max_size=6),
    data=st.data(),
    nxt=st.lists(tokens, min_size=1, max_size=6),
)
def test_negative_control_visible_rejected_position_is_detected(models, name, prefix, block, data, nxt):
    """After a partial commit, wrongly count one rejected position as committed: the oracle must see it.

    The same scenario done right passes in a second cache, so the difference comes from the stale position.
    """
    ours, oracle = models[name]
    c = data.draw(st.integers(0, len(block) - 1), label="c")
    # The rejected token must be new to the context: inserting a copy of a token into a run of that same token
    # (e.g. all zeros) changes no hidden state at all, so no oracle could tell.
    others = set(prefix + block[:c] + nxt)
    block = block[:c] + [data.draw(st.sampled_from(sorted(set(range(VOCAB)) - others)), label="rejected")] + block[c + 1 :]
    results = {}
    for wrong in (False, True):
        cache = ours.new_cache(MAX_LEN)
        slot = cache.allocate()
        _forward_blocks(ours, cache, [(slot, prefix)])
        cache.commit(slot, len(prefix))
        _forward_blocks(ours, cache, [(slot, block)])
        cache.commit(slot, c)
        if wrong:
            cache.slots[slot].length += 1  # the bug: the first rejected position stays visible
        (got,) = _forward_blocks(ours, cache, [(slot, nxt)])
        results[wrong] = _max_diff(got, oracle(prefix + block[:c] + nxt)[len(prefix) + c :])
    assert results[False] <= TOL, results
    assert results[True] > 1e-3, f"stale position went unnoticed: {results}"


# ---- plain KVCache invariants -----------------------------------------------------------------------------------
def _cache(max_len: int = 8, num_slots: int = 1) -> KVCache:
    return KVCache(num_layers=2, num_kv_heads=2, head_dim=4, max_len=max_len, num_slots=num_slots)


def test_reserve_twice_without_commit_raises():
    c = _cache()
    s = c.allocate()
    assert c.reserve(s, 3) == 0
    with pytest.raises(AssertionError, match="unresolved block"):
        c.reserve(s, 1)
    c.commit(s, 2)
    assert c.reserve(s, 1) == 2  # resolved: the next block opens after the committed positions


def test_commit_more_than_reserved_raises():
    c = _cache()
    s = c.allocate()
    c.reserve(s, 2)
    with pytest.raises(AssertionError):
        c.commit(s, 3)
    with pytest.raises(AssertionError):
        c.commit(s, -1)
    c.commit(s, 2)
    with pytest.raises(AssertionError):  # nothing pending any more
        c.commit(s, 1)
    assert c.length(s) == 2


def test_rollback_past_length_raises():
    c = _cache()
    s = c.allocate()
    c.reserve(s, 4)
    c.commit(s, 3)
    with pytest.raises(AssertionError, match="past committed length"):
        c.rollback(s, 4)
    with pytest.raises(AssertionError):
        c.rollback(s, -1)
    c.rollback(s, 1)
    assert c.length(s) == 1


def test_rollback_may_not_reach_into_pending_block():
    c = _cache()
    s = c.allocate()
    c.reserve(s, 3)
    with pytest.raises(AssertionError):  # pending positions are not committed: rollback cannot keep them
        c.rollback(s, 2)
    c.rollback(s, 0)
    assert c.slots[s].pending == 0 and c.length(s) == 0


def test_reserve_beyond_max_len_raises_cache_full():
    c = _cache(max_len=8)
    s = c.allocate()
    c.reserve(s, 6)
    c.commit(s, 6)
    with pytest.raises(CacheFullError, match="max_model_len"):
        c.reserve(s, 3)
    assert c.slots[s].pending == 0 and c.length(s) == 6  # the failed reserve left no trace
    assert c.reserve(s, 2) == 6  # exactly full is fine


def test_write_must_cover_the_reserved_block():
    c = _cache()
    s = c.allocate()
    c.reserve(s, 2)
    kv = torch.ones(2, 3, 4)
    with pytest.raises(AssertionError):
        c.write(0, s, 0, kv, kv)  # 3 positions into a block of 2
    with pytest.raises(AssertionError):
        c.write(0, s, 1, kv[:, :2], kv[:, :2])  # wrong start


def test_free_then_allocate_gives_clean_slot():
    c = _cache(num_slots=2)
    a, b = c.allocate(), c.allocate()
    assert (a, b) == (0, 1)
    with pytest.raises(CacheFullError):
        c.allocate()
    c.reserve(a, 5)
    c.commit(a, 4)
    c.reserve(a, 2)  # freed with a block still open
    c.free(a)
    assert not c.slots[a].in_use
    with pytest.raises(AssertionError, match="not allocated"):
        c.reserve(a, 1)
    assert c.allocate() == a
    st_ = c.slots[a]
    assert (st_.length, st_.pending, st_.in_use) == (0, 0, True)
    assert c.reserve(a, 3) == 0
    assert c.bytes_used() == 0


def test_free_then_allocate_model_ignores_old_kv(models):
    """A reused slot's old K/V (longer than the new sequence) never leaks into the new sequence's logits."""
    ours, oracle = models["llama"]
    cache = ours.new_cache(32)
    s = cache.allocate()
    _forward_blocks(ours, cache, [(s, list(range(20)))])
    cache.commit(s, 20)
    cache.free(s)
    assert cache.allocate() == s
    (got,) = _forward_blocks(ours, cache, [(s, [3, 1, 4, 1, 5])])
    _check(got, oracle, [], [3, 1, 4, 1, 5], "reused slot")
