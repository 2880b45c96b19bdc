"""Property tests of the paged KV cache's state (state/paged_kv.py, state/block_pool.py), no model: random
reserve / write / commit / rollback / free / prefix-hit sequences against a plain reference (per sequence the list
of values its committed positions must read back). After every operation: the asserted invariants (block tables
sized to their positions, refcounts = table entries, free / cached / used a partition), every committed position
reads back its value, rejected positions are gone, and no shared (hashed) block's content ever changes.

A position's value is a function of the tokens up to it (as a real K/V is), so a prefix hit must read back
exactly what computing the prompt would have written.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verispec.state.block_pool import BlockPool
from verispec.state.paged_kv import OutOfBlocks, PagedKVCache

B, NB, SLOTS, MAX_LEN = 4, 14, 3, 40
SYSTEM = [7, 7, 1, 2, 3, 9, 9, 4, 5]  # a shared "system prompt" (2 full blocks and a bit)


def _value(tokens: list[int]) -> float:
    """What position len(tokens)-1 of a sequence holds: a function of all tokens up to it."""
    return float(hash(tuple(tokens)) % 100003)


def _cache(prefix_caching: bool = True) -> PagedKVCache:
    return PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=1, max_len=MAX_LEN, num_blocks=NB, block_size=B,
                        num_slots=SLOTS, prefix_caching=prefix_caching)


class Model:
    """The reference: each live sequence's tokens (committed ones computed), and the hashed blocks' contents."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.seqs: dict[int, list[int]] = {}  # slot -> committed tokens
        self.prompts: dict[int, list[int]] = {}

    def check(self) -> None:
        c = self.cache
        c.check()
        for slot, toks in self.seqs.items():
            assert c.length(slot) == len(toks)
            k, v = c.read(0, slot, len(toks))
            want = torch.tensor([_value(toks[: p + 1]) for p in range(len(toks))])
            assert torch.equal(k[0, :, 0], want), f"sequence {slot} reads {k[0, :, 0].tolist()} not {want.tolist()}"
            assert torch.equal(v[0, :, 0], -want)
        for b, (_, tokens) in c.pool.hash_of.items():  # a hashed block holds its prompt block's values
            got = c.k[0][0, 0, b * B : (b + 1) * B, 0]
            assert got.tolist() == _shared_values(c, b), f"shared block {b} was modified"


_SNAPSHOT: dict[tuple[int, int], list[float]] = {}


def _shared_values(c: PagedKVCache, b: int) -> list[float]:
    """A hashed block's content when it was first seen hashed (its hash is its identity)."""
    key = (id(c), c.pool.hash_of[b][0])
    if key not in _SNAPSHOT:
        _SNAPSHOT[key] = c.k[0][0, 0, b * B : (b + 1) * B, 0].tolist()
    return _SNAPSHOT[key]


def _admit(m: Model, data) -> None:
    c = m.cache
    free = [i for i, s in enumerate(c.slots) if not s.in_use]
    if not free:
        return
    head = SYSTEM[: data.draw(st.integers(0, len(SYSTEM)), label="shared head")]
    prompt = head + data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=9), label="own tail")
    hits = c.match(prompt, len(prompt) - 1)
    slot = c.allocate(prompt, hits, len(prompt))
    m.seqs[slot] = prompt[: len(hits) * B]
    m.prompts[slot] = prompt


def _step(m: Model, data, slot: int) -> None:
    """Reserve n, write the block (prompt tokens first, then any), commit c of it or roll back."""
    c, toks, prompt = m.cache, m.seqs[slot], m.prompts[slot]
    n = data.draw(st.integers(0, min(6, MAX_LEN - len(toks))), label="n")
    block = [prompt[p] if p < len(prompt) else data.draw(st.integers(0, 3)) for p in range(len(toks), len(toks) + n)]
    before = ([s.blocks[:] for s in c.slots], c.pool.num_free)
    try:
        start = c.reserve(slot, n)
    except OutOfBlocks:
        assert ([s.blocks for s in c.slots], c.pool.num_free) == before, "a failed reservation changed the state"
        return
    vals = torch.tensor([_value(toks + block[: i + 1]) for i in range(n)]).view(1, n, 1)
    if n:
        c.write(0, slot, start, vals, -vals)
    if data.draw(st.integers(0, 5), label="resolve") > 0:
        keep = data.draw(st.integers(0, n), label="commit")
        c.commit(slot, keep)
        toks.extend(block[:keep])
    else:
        to = data.draw(st.integers(len(c.slots[slot].hashes) * B, len(toks)), label="rollback to")
        c.rollback(slot, to)
        del toks[to:]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), prefix_caching=st.booleans())
def test_random_operations_keep_every_invariant(data, prefix_caching):
    m = Model(_cache(prefix_caching))
    for _ in range(data.draw(st.integers(1, 30), label="n_ops")):
        op = data.draw(st.sampled_from(["admit", "step", "step", "step", "free"]), label="op")
        live = sorted(m.seqs)
        if op == "admit" or not live:
            _admit(m, data)
        elif op == "step":
            _step(m, data, data.draw(st.sampled_from(live), label="slot"))
        else:
            slot = data.draw(st.sampled_from(live), label="free")
            m.cache.free(slot)
            del m.seqs[slot], m.prompts[slot]
        m.check()


def test_prefix_hit_shares_blocks_and_counts_tokens():
    c = _cache()
    prompt = SYSTEM[:8] + [1, 2, 3]  # 2 full blocks + 3
    a = c.allocate(prompt, c.match(prompt, len(prompt) - 1), len(prompt))
    assert c.prefix_queries == 11 and c.prefix_hits == 0
    c.reserve(a, 10)
    c.commit(a, 10)  # prompt[:-1] computed: both full blocks hashed
    assert len(c.slots[a].hashes) == 2 and c.pool.num_used == 3
    b_prompt = SYSTEM[:8] + [0]
    hits = c.match(b_prompt, len(b_prompt) - 1)
    assert hits == c.table(a)[:2]
    b = c.allocate(b_prompt, hits, len(b_prompt))
    assert c.length(b) == 8 and c.prefix_queries == 20 and c.prefix_hits == 8
    assert [c.pool.ref[x] for x in hits] == [2, 2]
    assert c.reserve(b, 1) == 8 and c.table(b)[2] not in c.table(a), "first own position starts a fresh block"
    c.commit(b, 1)
    c.check()
    c.free(a)
    c.free(b)
    assert c.pool.num_free == NB and len(c.pool.cached) == 2, "freed hashed blocks stay cached"
    # only the last prompt token's position is never skipped: a prompt of exactly 2 blocks hits 1
    assert len(c.match(SYSTEM[:8], 8 - 1)) == 1


def test_reset_forgets_cached_blocks_only_when_no_sequence_holds_blocks():
    """While a sequence holds blocks the reset refuses and changes nothing; after, every cached block is free (no
    hash, lowest first again) and the prompt hits nothing; the hit counters are lifetime totals and stay."""
    c = _cache()
    prompt = SYSTEM[:8] + [1, 2, 3]
    a = c.allocate(prompt, c.match(prompt, len(prompt) - 1), len(prompt))
    c.reserve(a, 10)
    c.commit(a, 10)
    hashed = dict(c.pool.hash_of)
    assert not c.reset_prefix_cache() and c.pool.hash_of == hashed and c.prefix_queries == 11
    c.free(a)
    assert len(c.pool.cached) == 2 and len(c.match(prompt, len(prompt) - 1)) == 2
    totals = (c.prefix_queries, c.prefix_hits)
    assert c.reset_prefix_cache()
    assert not c.pool.cached and not c.pool.hash_of and not c.pool.by_hash and c.pool.num_free == NB
    assert (c.prefix_queries, c.prefix_hits) == totals and c.match(prompt, len(prompt) - 1) == []
    c.check()
    s = c.allocate()
    c.reserve(s, 2 * B)
    assert c.table(s) == [0, 1], "free blocks are handed out lowest first again"
    c.check()


def test_cached_blocks_evicted_least_recent_first_and_rejected_blocks_returned():
    pool = BlockPool(3, B)
    blocks = [pool.take(), pool.take(), pool.take()]
    assert blocks == [0, 1, 2]
    for i, b in enumerate(blocks):
        assert pool.register(b, 100 + i, [i] * B)
    for b in (2, 0, 1):  # freed in this order
        pool.release(b)
    assert pool.num_free == 3 and pool.take() == 2 and 102 not in pool.by_hash
    c = _cache(False)
    s = c.allocate()
    c.reserve(s, 3)
    c.commit(s, 3)
    c.reserve(s, 4)  # a speculative block: positions 3..6 take a second block
    assert len(c.table(s)) == 2
    c.commit(s, 1)  # only position 3 accepted: the block held only rejected positions and goes back
    assert len(c.table(s)) == 1 and c.pool.num_used == 1
    c.check()


def test_lone_sequence_gets_consecutive_blocks_and_writes_are_private():
    c = _cache()
    s = c.allocate(list(range(12)), [], 12)
    for _ in range(5):
        c.reserve(s, 2)
        c.commit(s, 2)
    assert c.table(s) == [0, 1, 2]
    with pytest.raises(AssertionError, match="rollback into a shared"):
        c.rollback(s, 3)  # blocks 0 and 1 are full prompt blocks: hashed, shareable, never rewritten


def test_peak_counts_the_most_blocks_in_tables_at_once():
    pool = BlockPool(num_blocks=6, block_size=2)
    a, b, c = pool.take(), pool.take(), pool.take()
    pool.register(a, 11, [1, 2])
    for blk in (a, b, c):
        pool.release(blk)  # a stays cached, b and c free: nothing is in a table
    assert pool.num_used == 0 and pool.peak_used == 3
    pool.acquire(a)  # a prefix hit takes the cached block back
    d = pool.take()
    assert pool.num_used == 2 and pool.peak_used == 3
    e, f = pool.take(), pool.take()
    assert pool.num_used == 4 and pool.peak_used == 4
    assert len({a, d, e, f}) == 4


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="RSS is read from /proc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_cache_takes_memory_as_positions_are_written_not_for_its_capacity(dtype: torch.dtype) -> None:
    """256 MiB of K/V (float32; half of it in 16-bit) allocated: zero everywhere, and the process's RSS grows by a
    few MiB, not by the capacity; writing one block per sequence takes those blocks' pages only. The slot cache
    (state/kv_cache.py) the same. torch.zeros would take it all at once (this test fails with it)."""
    from verispec.state.kv_cache import KVCache

    before = _rss_mib()
    c = PagedKVCache(num_layers=16, num_kv_heads=4, head_dim=64, max_len=4096, num_blocks=4096, block_size=16,
                     num_slots=4, dtype=dtype)
    capacity = sum(t.numel() * t.element_size() for t in c.k + c.v) / 2**20
    assert capacity >= 128 and _rss_mib() - before < 16
    for t in (c.k[0], c.v[-1]):  # zero where read, without a page of it being taken
        assert t.dtype == dtype and t.is_contiguous() and not t[0, :, ::997].any()
    for layer in range(16):
        c.k[layer][0, :, :16] = 1.0  # one block of every head
    assert _rss_mib() - before < 16 and float(c.k[3][0, 2, :16].float().sum()) == 16 * 64
    slots = KVCache(num_layers=16, num_kv_heads=4, head_dim=64, max_len=4096, num_slots=4, dtype=dtype)
    assert _rss_mib() - before < 24 and not slots.v[5][3, 1].any()
