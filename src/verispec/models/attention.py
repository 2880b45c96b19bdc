"""Attention of a ragged block of new tokens over the KV cache, in few batched calls per layer.

`plan_attention` (once per forward and window size) splits the block's rows into groups; `attend_group` (per layer)
runs each group as ONE batched softmax(q k^T / sqrt(hd)) v. A group is E entries of n query rows each, attending to
E key ranges of one length L: an entry's keys are L consecutive cache positions of one slot, read as a view of the
cache (one entry, or consecutive slots at one offset), as one shared view (every entry reads the same keys: per
KV head a batch whose key operand is broadcast, no copy), or gathered with `index_select` (anything else). Keys past
an entry's own range are masked.

- Default path: a segment is one entry with all its rows (per KV head its G n query rows form one matrix, as a lone
  segment always did); segments of one short length (decode steps, verify blocks) share a group, their key ranges
  padded to the longest. A lone segment computes exactly what it computed before batching existed.
- Per-query path (`LlamaModel.batch_invariant`): every query row is its own entry whose key range is padded to
  `bucket(count)` keys, a length that depends only on the row's own position. So every row runs the same shapes,
  whatever block or batch it is in, and rows of one bucket share a group: a batched matmul computes each batch entry
  as it computes a batch of one, so a row's output is bitwise the same alone, in a block, or beside other requests
  (CPU fp32 matmuls do round differently by row and column count, which is why a row never shares a matrix).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

from verispec.models.tree import ancestor_mask, depths

BATCH_MAX_LEN = 16  # default path: segments up to this long (decode, verify) share a call with same-length ones
# default path: padded (wasted) key x query rows a shared call may add before its segments are split by key count;
# about where one more call's overhead (~15 small ops) costs what that much extra matmul work does on CPU
PAD_KEYS = 512
# a call's gathered keys + scores stay under this many elements (a group past it is split; rows' results do not
# depend on the split): a long windowed per-query prefill must not gather every row's keys at once
GROUP_ELEMENTS = 1 << 24
SHARED_MIN = 4  # rows of one slot in a group (a verify block) that get their own call on a shared view of its keys


class SegmentLike(Protocol):
    slot: int
    start: int
    length: int
    tree: tuple[int, ...] | None  # a draft tree's parent links (models/tree.py), None for a chain


@dataclass(frozen=True)
class CacheShape:
    """What planning needs to know of the model and the cache."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_len: int  # T: positions per slot (the paged cache: its whole pool, num_blocks B, as one slot)
    dtype: torch.dtype  # the scores': the cache's (float32 over a CPU float16 cache)
    device: torch.device
    block_size: int | None = None  # B of a paged cache (its plans get the block tables)


@dataclass(frozen=True)
class _Entry:
    """n query rows of one slot at positions first .. first+n-1, reading keys lo .. lo+count-1 (the last row's)."""

    slot: int
    first: int
    n: int
    lo: int
    rows: range  # their rows in the block
    # a paged sequence whose keys are not one run of the pool: the physical blocks holding its (logical) keys
    # lo // B .. (last key) // B, gathered. (One whose keys are consecutive is slot 0 at physical positions.)
    blocks: tuple[int, ...] | None = None
    # rows of a draft tree: per row, the keys hidden from it besides the causal mask (its non-ancestors in the tree,
    # as offsets from the row's own position) and its RoPE position minus its cache position (-(row - depth))
    hide: tuple[tuple[int, ...], ...] = ()
    shift: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        return self.first + self.n - self.lo


@dataclass(frozen=True)
class KeyGroup:
    """E entries x n query rows attended in one batched call, over L keys per entry."""

    rows: slice  # the group's rows of the plan's sorted block, entry-major
    n: int  # query rows per entry
    length: int  # L
    view: tuple[int, int, int] | None  # (first slot, last slot + 1, first key position): keys are a cache view
    shared: bool  # view of one slot read by every entry (E > 1): per KV head a broadcast key operand
    index: torch.Tensor | None  # otherwise [E K L] rows of the cache layer viewed as [slots K T, hd] to gather
    bias: torch.Tensor | None  # added to the scores, -inf where a key is hidden (None: nothing hidden), shaped as
    # the group's scores broadcast: [E K or 1, G n or 1, L], or [E, G n or 1, L] for a shared view


@dataclass(frozen=True)
class AttentionPlan:
    """How one window size's attention runs: the rows sorted so that each group's rows are consecutive."""

    order: torch.Tensor | None  # [N] block row of each sorted row, None = the block's own order
    restore: torch.Tensor | None  # [N] sorted row of each block row
    groups: tuple[KeyGroup, ...]


def bucket(count: int) -> int:
    """The key-range length the per-query path pads `count` keys to: a multiple of 16, or of 1/8 of count's power
    of two once that is larger (at most 1/8 extra keys past 128), so that few buckets cover many positions."""
    step = max(16, 1 << max(0, count.bit_length() - 4))
    return -(-count // step) * step


# ---- planning (once per forward) ------------------------------------------------------------------------------
def plan_attention(segments: Sequence[SegmentLike], window: int | None, per_query: bool, shape: CacheShape,
                   tables: Mapping[int, Sequence[int]] | None = None) -> AttentionPlan:
    """The groups of one window size's attention over `segments` (their rows concatenated in segment order).
    `tables`: a paged cache's block table per segment slot (see `_physical`)."""
    entries = _query_entries(segments, window) if per_query else _segment_entries(segments, window)
    if tables is not None:
        runs = {slot: _run_starts(table) for slot, table in tables.items()}
        entries = [_physical(e, tables[e.slot], runs[e.slot], shape.block_size) for e in entries]  # type: ignore
    grouped = _by_bucket(entries) if per_query else _by_length(entries)
    calls = [(length, part) for length, es in grouped for part in _calls(es, length, shape)]
    order = [r for _, es in calls for e in es for r in e.rows]
    groups, start = [], 0
    for length, es in calls:
        stop = start + sum(e.n for e in es)
        groups.append(_key_group(es, slice(start, stop), length, window, shape))
        start = stop
    if order == list(range(len(order))):
        return AttentionPlan(None, None, tuple(groups))
    order_t = torch.tensor(order, device=shape.device)
    return AttentionPlan(order_t, torch.argsort(order_t), tuple(groups))


def _run_starts(table: Sequence[int]) -> list[int]:
    """[j] the first logical block of the run of physically consecutive blocks that holds block j."""
    out = []
    for j, b in enumerate(table):
        out.append(out[-1] if j and b == table[j - 1] + 1 else j)
    return out


def _physical(e: _Entry, table: Sequence[int], runs: Sequence[int], B: int) -> _Entry:
    """A paged entry in the slot cache's terms. Keys in consecutive blocks: slot 0 (the pool as one slot) with its
    positions shifted to the physical ones (masks depend only on key - query positions, so they are unchanged) and
    read as views like a slot's. Otherwise: its logical positions with the blocks to gather them from."""
    j0, j1 = e.lo // B, (e.first + e.n - 1) // B
    if runs[j1] <= j0:  # blocks j0 .. j1 are one run
        delta = table[j0] * B + e.lo % B - e.lo
        return replace(e, slot=0, first=e.first + delta, lo=e.lo + delta)
    return replace(e, blocks=tuple(table[j0 : j1 + 1]))


def _by_bucket(entries: list[_Entry]) -> list[tuple[int, list[_Entry]]]:
    """Per-query path: (bucket length, its rows), in order of first appearance."""
    grouped: dict[int, list[_Entry]] = {}
    for e in entries:
        grouped.setdefault(bucket(e.count), []).append(e)
    return list(grouped.items())


def _by_length(entries: list[_Entry]) -> list[tuple[int, list[_Entry]]]:
    """Default path: (key length, segments) groups: segments of one short length together unless padding them to the
    longest wastes more than PAD_KEYS (then runs of similar key counts); long segments alone."""
    grouped: dict[int, list[_Entry]] = {}
    for i, e in enumerate(entries):
        grouped.setdefault(e.n if e.n <= BATCH_MAX_LEN else -1 - i, []).append(e)
    runs = [run for es in grouped.values() for run in _pad_bounded(es)]
    return [(max(e.count for e in run), run) for run in runs]


def _pad_bounded(es: list[_Entry]) -> list[list[_Entry]]:
    """Entries of one length n as one run if padding each to the longest wastes at most PAD_KEYS key rows, else
    runs of ascending key count that each do."""
    n, counts = es[0].n, [e.count for e in es]
    if n * (len(es) * max(counts) - sum(counts)) <= PAD_KEYS:
        return [es]
    runs: list[list[_Entry]] = [[]]
    total = 0  # key count summed over the current run
    for e in sorted(es, key=lambda e: e.count):
        if runs[-1] and n * ((len(runs[-1]) + 1) * e.count - total - e.count) > PAD_KEYS:
            runs.append([])
            total = 0
        runs[-1].append(e)
        total += e.count
    return runs


def _calls(es: list[_Entry], length: int, shape: CacheShape) -> list[list[_Entry]]:
    """A group's entries as the calls that run it, each within GROUP_ELEMENTS: one call when their keys are one view
    (one slot, or slots in order); else, by slot, a call on a shared view per slot with SHARED_MIN or more rows
    (a verify block) and the other rows as runs of consecutive slots (views) when there are at most a quarter as
    many runs as rows, else as one gather. Views cost no copy; each call costs ~15 small ops."""
    lo, slots = es[0].lo, [e.slot for e in es]
    if not all(e.lo == lo and e.blocks is None for e in es) or lo + length > shape.max_len:
        return _split(es, length, shape)  # gathered
    if slots.count(slots[0]) == len(slots) or slots == list(range(slots[0], slots[0] + len(es))):
        return _split(es, length, shape)  # one view
    by_slot: dict[int, list[_Entry]] = {}
    for e in sorted(es, key=lambda e: e.slot):
        by_slot.setdefault(e.slot, []).append(e)
    calls = [rows for rows in by_slot.values() if len(rows) >= SHARED_MIN]
    rest = [e for rows in by_slot.values() if len(rows) < SHARED_MIN for e in rows]
    runs: list[list[_Entry]] = []
    for e in rest:
        if runs and runs[-1][-1].slot + 1 == e.slot:
            runs[-1].append(e)
        else:
            runs.append([e])
    calls += runs if len(runs) <= len(rest) // 4 else [rest] if rest else []
    return [chunk for call in calls for chunk in _split(call, length, shape)]


def _split(es: list[_Entry], length: int, shape: CacheShape) -> list[list[_Entry]]:
    """`es` in runs of at most GROUP_ELEMENTS gathered keys and scores (one run unless the group is huge)."""
    per_entry = shape.num_kv_heads * length * (shape.head_dim + shape.num_heads // shape.num_kv_heads * es[0].n)
    size = max(1, GROUP_ELEMENTS // per_entry)
    return [es[i : i + size] for i in range(0, len(es), size)]


def _segment_entries(segments: Sequence[SegmentLike], window: int | None) -> list[_Entry]:
    """Default path: one entry per segment, reading from the first key its first row may see."""
    out, off = [], 0
    for s in segments:
        lo = 0 if window is None else max(0, s.start - window + 1)
        hide, shift = _tree_rows(s, window)
        out.append(_Entry(s.slot, s.start, s.length, lo, range(off, off + s.length), hide=hide, shift=shift))
        off += s.length
    return out


def _query_entries(segments: Sequence[SegmentLike], window: int | None) -> list[_Entry]:
    """Per-query path: one entry per row, reading exactly the keys its position sees."""
    out, off = [], 0
    for s in segments:
        hide, shift = _tree_rows(s, window)
        for i, p in enumerate(range(s.start, s.start + s.length)):
            lo = 0 if window is None else max(0, p + (shift[i] if shift else 0) - window + 1)
            out.append(_Entry(s.slot, p, 1, lo, range(off, off + 1), hide=hide[i : i + 1], shift=shift[i : i + 1]))
            off += 1
    return out


def _tree_rows(s: SegmentLike, window: int | None) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """A tree segment's per-row hidden keys (non-ancestors, as offsets from the row) and RoPE shifts; () for a
    chain. A window must reach past the tree's depth (an ancestor is never out of a row's window)."""
    if s.tree is None:
        return (), ()
    visible, depth = ancestor_mask(s.tree).tolist(), depths(s.tree)
    assert window is None or window > max(depth), f"a window of {window} is shorter than the draft tree's depth"
    hide = tuple(tuple(b - a for b in range(a) if not visible[a][b]) for a in range(s.length))
    return hide, tuple(d - a for a, d in enumerate(depth))


def _key_group(es: list[_Entry], rows: slice, length: int, window: int | None, shape: CacheShape) -> KeyGroup:
    """Where the group's keys come from (a view when they lie so in the cache, else a gather) and its mask."""
    lo, slots, n = es[0].lo, [e.slot for e in es], es[0].n
    K, G, max_len, device = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.max_len, shape.device
    view = shared = None
    if all(e.lo == lo and e.blocks is None for e in es) and lo + length <= max_len:
        if len(es) > 1 and all(s == slots[0] for s in slots):
            view, shared = (slots[0], slots[0] + 1, lo), True
        elif slots == list(range(slots[0], slots[0] + len(es))):
            view = (slots[0], slots[0] + len(es), lo)
    index = None if view is not None else _gather_index(es, length, K, max_len, shape.block_size).to(device)
    bias = None
    if n > 1 or any(e.count < length or e.hide for e in es):
        blocked = _blocked(es, length, window, G)  # [E, M, L], M = G n or 1
        bias = torch.zeros(blocked.shape, dtype=shape.dtype).masked_fill_(blocked, float("-inf"))
        if not shared and len(es) > 1:  # one row per (entry, KV head) of the batched scores
            bias = bias.repeat_interleave(K, dim=0)  # [E K, M, L]
        bias = bias.to(device)
    return KeyGroup(rows, n, length, view, bool(shared), index, bias)


def _gather_index(es: list[_Entry], length: int, K: int, max_len: int, B: int | None = None) -> torch.Tensor:
    """[E K L] rows of a cache layer viewed as [slots K T, hd]: entry e's keys lo_e .. lo_e+L-1 per KV head
    (positions past the cache, or past a paged entry's own keys, clamped to its last one; they are masked)."""
    slot = torch.tensor([e.slot for e in es])
    lo = torch.tensor([e.lo for e in es])
    base = (slot[:, None] * K + torch.arange(K)) * max_len  # [E, K]
    pos = (lo[:, None] + torch.arange(length)).clamp_(max=max_len - 1)  # [E, L]
    paged = [i for i, e in enumerate(es) if e.blocks is not None]
    if paged:  # logical -> physical positions through each entry's blocks; base: slot 0 (the pool)
        assert B is not None
        width = max(len(es[i].blocks) for i in paged)  # type: ignore[arg-type]
        blocks = torch.tensor([list(es[i].blocks) + [0] * (width - len(es[i].blocks)) for i in paged])  # [P, W]
        first = lo[paged] // B * B  # [P] logical start of each entry's first block
        last = torch.tensor([es[i].first + es[i].n - 1 for i in paged])  # [P] its last key
        logical = torch.minimum(lo[paged][:, None] + torch.arange(length), last[:, None]) - first[:, None]  # [P, L]
        pos[paged] = blocks.gather(1, logical // B) * B + logical % B
        base[paged] = torch.arange(K) * max_len
    return (base[:, :, None] + pos[:, None, :]).reshape(-1)


def _blocked(es: list[_Entry], length: int, window: int | None, G: int) -> torch.Tensor:
    """[E, G n, L] (n > 1; rows ordered (g, i) like the queries) or [E, 1, L]: True where a key is hidden from a
    row: after it, out of its window, or padding."""
    n = es[0].n
    q_pos = torch.tensor([e.first for e in es])[:, None, None] + torch.arange(n)[:, None]  # [E, n, 1]
    k_pos = torch.tensor([e.lo for e in es])[:, None, None] + torch.arange(length)  # [E, 1, L]
    hidden = k_pos > q_pos  # [E, n, L]
    if window is not None:
        if any(e.shift for e in es):  # a tree row's window ends at its RoPE position, not its cache position
            q_pos = q_pos + torch.tensor([e.shift or (0,) * n for e in es])[:, :, None]  # [E, n, 1]
        hidden |= k_pos <= q_pos - window
    for i, e in enumerate(es):
        for r, offsets in enumerate(e.hide):  # a tree row's non-ancestors
            hidden[i, r, [e.first + r + o - e.lo for o in offsets]] = True
    if n == 1:
        return hidden
    return hidden[:, None].expand(len(es), G, n, length).reshape(len(es), G * n, length)


def kv_rows(segments: Sequence[SegmentLike], num_kv_heads: int, max_len: int, device: torch.device) -> torch.Tensor:
    """[N K] rows of a cache layer viewed as [slots K T, hd] that the block's N new tokens' K/V go to, token-major."""
    slot = torch.tensor([s.slot for s in segments for _ in range(s.length)])
    pos = torch.tensor([p for s in segments for p in range(s.start, s.start + s.length)])
    return ((slot[:, None] * num_kv_heads + torch.arange(num_kv_heads)) * max_len + pos[:, None]).reshape(-1).to(device)


# ---- attention (per layer and group) ----------------------------------------------------------------------------
# an attention kernel standing in for `_attention` on CPU: (q [B, M, hd], k, v [B, L, hd], bias [B?, M?, L] or
# None) -> [B, M, hd] (kernels/cpu_kernels.py's `Library.attention`, run by the gguf-q8act path)
AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def scores_dtype(cache: torch.dtype, device: torch.device) -> torch.dtype:
    """What attention computes in over a cache of this dtype: the cache's own, but float32 over a CPU float16
    cache (its keys and values are read into float32 exactly)."""
    return torch.float32 if cache is torch.float16 and device.type == "cpu" else cache


def attend_group(q: torch.Tensor, g: KeyGroup, ck: torch.Tensor, cv: torch.Tensor,
                 kernel: AttentionKernel | None = None) -> torch.Tensor:
    """q: [E n, H, hd] the group's rows, entry-major, in the cache's dtype (float32 over a CPU float16 cache); ck, cv:
    [slots, K, T, hd] one layer of the cache (already holding this block's K/V) -> [E n, H hd] in q's dtype.
    `kernel`: the CPU attention arithmetic to use instead of torch's batched matmuls (None: torch's)."""
    K, hd, n = ck.shape[1], ck.shape[3], g.n
    E, G = q.shape[0] // n, q.shape[1] // K
    if n == 1:  # one matrix per (entry, KV head): the G query heads sharing it
        qs = q.reshape(E * K, G, hd)
    else:  # per (entry, KV head) the G n rows ordered (g, i)
        qs = q.reshape(E, n, K, G, hd).permute(0, 2, 3, 1, 4).reshape(E * K, G * n, hd)
    if g.shared:
        o = _attend_shared(qs.reshape(E, K, G * n, hd), *_in(q.dtype, *_view(ck, cv, g)), g.bias, kernel)
    else:
        keys, vals = _view(ck, cv, g) if g.view is not None else _gather(ck, cv, g)  # [E K, L, hd] each
        o = _attention(qs, *_in(q.dtype, keys, vals), g.bias, kernel)
    if n == 1:
        return o.reshape(E, K * G * hd)
    return o.reshape(E, K, G, n, hd).permute(0, 3, 1, 2, 4).reshape(E * n, K * G * hd)


def _in(dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values in the queries' dtype: a float16 cache's, read into float32 (exactly) on CPU."""
    return (k, v) if k.dtype is dtype else (k.to(dtype), v.to(dtype))


def _view(ck: torch.Tensor, cv: torch.Tensor, g: KeyGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's keys and values as views of the cache: [E K, L, hd] each ([K, L, hd] for one slot)."""
    a, b, lo = g.view  # type: ignore[misc]
    hi = lo + g.length
    if b == a + 1:
        return ck[a, :, lo:hi], cv[a, :, lo:hi]
    return ck[a:b, :, lo:hi].flatten(0, 1), cv[a:b, :, lo:hi].flatten(0, 1)


def _gather(ck: torch.Tensor, cv: torch.Tensor, g: KeyGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's keys and values copied out of the cache: [E K, L, hd] each."""
    hd = ck.shape[-1]
    return (ck.view(-1, hd).index_select(0, g.index).view(-1, g.length, hd),  # type: ignore[arg-type]
            cv.view(-1, hd).index_select(0, g.index).view(-1, g.length, hd))  # type: ignore[arg-type]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
               kernel: AttentionKernel | None = None) -> torch.Tensor:
    """q: [E K, M, hd]; k, v: [E K, L, hd]; bias: [E K or 1, M or 1, L]. Returns [E K, M, hd].

    On CUDA this is SDPA's fused kernel. On CPU the given kernel, or an explicit softmax(q k^T / sqrt(hd) + bias) v
    in the cache's dtype (fp32 on CPU, where bf16 batched matmuls are slow), far cheaper than SDPA's CPU fallback
    for short blocks.
    """
    if q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    if kernel is not None:
        return kernel(q, k, v, bias)
    scores = _scores(q, k.transpose(1, 2), bias)  # [E K, M, L]
    return torch.bmm(torch.softmax(scores, dim=-1), v)


def _attend_shared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   kernel: AttentionKernel | None = None) -> torch.Tensor:
    """q: [E, K, M, hd]; k, v: [K, L, hd] read by every entry; bias: [E, M or 1, L]. Returns [E, K, M, hd].

    Per KV head one batch of E matrices whose key operand is the same view broadcast E times: the same per-entry
    matmuls as `_attention`, without copying the keys E times."""
    E, K, M, hd = q.shape
    L = k.shape[1]
    if q.is_cuda:
        mask = None if bias is None else bias[:, None]  # [E, 1, M or 1, L]
        return F.scaled_dot_product_attention(q, k.expand(E, K, L, hd), v.expand(E, K, L, hd), attn_mask=mask)
    if kernel is not None:  # per KV head, the shared keys as a batch stride of 0
        return torch.stack([kernel(q[:, h], k[h].expand(E, L, hd), v[h].expand(E, L, hd), bias)
                            for h in range(K)], 1)
    scores = q.new_empty(K, E, M, L)
    for h in range(K):
        _scores(q[:, h], k[h].expand(E, L, hd).transpose(1, 2), bias, out=scores[h])  # [E, M, L]
    probs = torch.softmax(scores, dim=-1)
    out = q.new_empty(K, E, M, hd)
    for h in range(K):
        torch.bmm(probs[h], v[h].expand(E, L, hd), out=out[h])  # [E, M, hd]
    return out.transpose(0, 1)


def _scores(q: torch.Tensor, k_t: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
            ) -> torch.Tensor:
    """q: [B, M, hd], k_t: [B, hd, L] -> q k^T / sqrt(hd) + bias: [B, M, L].

    One baddbmm (scale and mask inside the matmul call) when 1/sqrt(hd) is a power of two: scaling by it is exact,
    so this rounds exactly as scaling after the matmul does. Otherwise the matmul, then the scale, then the bias."""
    scale = q.shape[-1] ** -0.5
    if _power_of_two(scale):
        if bias is None:
            return torch.baddbmm(_zero(q.dtype, q.device), q, k_t, beta=0, alpha=scale, out=out)
        return torch.baddbmm(bias, q, k_t, alpha=scale, out=out)
    scores = torch.bmm(q, k_t, out=out).mul_(scale)
    return scores if bias is None else scores.add_(bias)


def _power_of_two(x: float) -> bool:
    return math.frexp(x)[0] == 0.5


@functools.lru_cache(maxsize=None)
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, 1, 1] zero: the ignored `input` of a beta=0 baddbmm."""
    return torch.zeros(1, 1, 1, dtype=dtype, device=device)
