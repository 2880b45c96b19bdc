"""Every decoder layer of a forward in one call of verispec's CPU kernel (csrc/cpu.c's `vs_decoder`), for the
gguf-q8act path.

On that path a layer is already a handful of kernel calls (norm + qkv, RoPE, attention, o + residual, norm +
gate_up, SwiGLU + down + residual), but each is reached through Python: at one token per step the calls, their
argument checks and the attention plan cost about as much as the arithmetic. `vs_decoder` runs the same C functions
in the same order for all layers, so its result is bitwise the layer-by-layer one (the tests hold it to that), in
one call. It covers what the path's layers do without extra weights: fused GGUF-block linears everywhere, no
biases, no q/k norm, float32 activations and cache. The rows may belong to several sequences of a slot cache or a
paged one, as chains or draft trees of up to 64 rows (a node attends to the context, its ancestors and itself, at
the RoPE position of its depth); each row attends alone (its own keys, in ascending position), so the result is
batch-invariant as the path is.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from verispec.config import ModelConfig
from verispec.kernels.cpu_kernels import Library, load
from verispec.kernels.q8act import Q8ActWeight
from verispec.kernels.threads import kernel_threads
from verispec.models.tree import ancestor_mask, depths

_p, _i32, _i64, _u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
TREE_ROWS = 64  # a tree block's rows are one bit each of a 64-bit mask


class _Layer(ctypes.Structure):  # csrc/cpu.c's vs_layer
    _fields_ = [("qkv", _p), ("o", _p), ("gate_up", _p), ("down", _p), ("qkv_layout", _p), ("o_layout", _p),
                ("gate_up_layout", _p), ("down_layout", _p), ("qkv_parts", _i32), ("o_parts", _i32),
                ("gate_up_parts", _i32), ("down_parts", _i32), ("attn_norm", _p), ("mlp_norm", _p), ("window", _i64)]


def _array(ctype: type, values: Sequence[int]) -> ctypes.Array:
    return (ctype * len(values))(*values)


class DecoderKernel:
    """The decoder layers of one model as one kernel call: `run(x, segments, cache, cos, sin, capture)`.
    Build with `DecoderKernel.build(model)`, which says None where the model's layers are not all covered."""

    def __init__(self, cfg: ModelConfig, layers: Sequence[torch.nn.Module], lib: Library) -> None:
        self.cfg, self.lib = cfg, lib
        # the tensors the table points into stay alive with it; a model moved or cast since (new tensors) is
        # no longer covered (`covers` compares the first layer's norm and qkv tiles with the ones built on)
        names = ("qkv", "o", "gate_up", "down")
        self._keep = [getattr(L, n) for L in layers for n in names] + [L.attn_norm for L in layers] + [
            L.mlp_norm for L in layers]
        self._first = layers[0]
        self._built_on = (self._first.attn_norm, self._first.qkv.tiles)
        self._windows = {cfg.layer_window(i) for i in range(len(layers))}
        self._table = (_Layer * len(layers))(*[
            _Layer(*[getattr(L, n).tiles.data_ptr() for n in names], *[getattr(L, n).layout.data_ptr() for n in names],
                   *[getattr(L, n).layout.shape[0] for n in names], L.attn_norm.data_ptr(), L.mlp_norm.data_ptr(),
                   cfg.layer_window(i) or 0)
            for i, L in enumerate(layers)])

    @classmethod
    def build(cls, model: torch.nn.Module) -> DecoderKernel | None:
        """The kernel for `model`'s layers (a CPU float32 model whose linears are all `Q8ActWeight`s, without
        biases or q/k norm), or None."""
        layers = list(model.layers)  # type: ignore[attr-defined]
        for L in layers:
            if any(getattr(L, b) is not None for b in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "q_norm")):
                return None
            if not all(isinstance(getattr(L, w), Q8ActWeight) for w in ("qkv", "o", "gate_up", "down")):
                return None
            if L.attn_norm.dtype is not torch.float32 or L.attn_norm.device.type != "cpu":
                return None
        return cls(model.cfg, layers, load())  # type: ignore[attr-defined]

    def covers(self, segments: Sequence, cache: object) -> bool:
        """Whether a forward over `segments` into `cache` can run here: the weights it was built on, chains or trees
        of at most TREE_ROWS rows, a float32 or float16 CPU cache."""
        k0 = cache.k[0]  # type: ignore[attr-defined]
        first = self._first
        same_weights = first.attn_norm is self._built_on[0] and first.qkv.tiles is self._built_on[1]
        return (same_weights and k0.dtype in (torch.float32, torch.float16) and k0.device.type == "cpu"
                and k0.is_contiguous()
                and all(s.tree is None or self._tree_fits(s) for s in segments))

    def _tree_fits(self, s) -> bool:
        """A tree of at most TREE_ROWS rows whose depth every window reaches past (else the layer-by-layer path
        says why it cannot run)."""
        return s.length <= TREE_ROWS and all(w is None or w > max(depths(s.tree)) for w in self._windows)

    def run(self, x: torch.Tensor, segments: Sequence, cache: object, cos: torch.Tensor, sin: torch.Tensor,
            capture: Sequence[int] = ()) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """x: [N, d] float32, the segments' embedded tokens in segment order, replaced in place by the last layer's
        output; their K/V are written into `cache` (blocks already reserved); cos, sin: [N, (1,) hd] the rows'
        RoPE (a float16 cache: K/V rounded to nearest even as written, as torch's `.half()` rounds, and read back
        exactly). Returns ({layer i: [N, d] the hidden state entering layer i}, for i in `capture` below num_layers,
        and the [N, k d] buffer those are column views of, in ascending layer order; None when nothing is
        captured): a drafter's features are then one slice of it, not a concatenation per step."""
        c = self.cfg
        n = x.shape[0]
        if x.dtype is not torch.float32 or not x.is_contiguous() or x.shape[1] != c.hidden_size:
            raise ValueError(f"decoder kernel: x must be a contiguous float32 [N, {c.hidden_size}]")
        cos = cos.reshape(n, c.head_dim).contiguous()
        sin = sin.reshape(n, c.head_dim).contiguous()
        pos, rpos, hi, anc, base, toff, tables, bs, hstride = _addressing(segments, cache)
        layers = sorted({i for i in capture if i < c.num_layers})
        d = c.hidden_size
        packed = x.new_empty(n, len(layers) * d) if layers else None
        hidden = {i: packed[:, k * d : (k + 1) * d] for k, i in enumerate(layers)} if packed is not None else {}
        caps = _array(_p, [hidden[i].data_ptr() if i in hidden else 0 for i in range(c.num_layers)]) if hidden else None
        half = int(cache.k[0].dtype is torch.float16)  # type: ignore[attr-defined]
        rc = self.lib.lib.vs_decoder(
            self._table, c.num_layers, _array(_p, [t.data_ptr() for t in cache.k]),  # type: ignore[attr-defined]
            _array(_p, [t.data_ptr() for t in cache.v]), c.hidden_size, c.num_heads,  # type: ignore[attr-defined]
            c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps, c.head_dim**-0.5, x.data_ptr(), n,
            cos.data_ptr(), sin.data_ptr(), pos, rpos, hi, anc, base, tables, toff, bs, hstride, caps,
            len(layers) * d, half, kernel_threads())
        if rc:
            raise RuntimeError(f"vs_decoder failed ({'bad shapes' if rc == -1 else 'out of memory'})")
        return hidden, packed


def _addressing(segments: Sequence, cache: object) -> tuple:
    """Per row: its cache position, RoPE position, the end of its consecutive visible keys and the bits of the
    tree rows it also sees (csrc/cpu.c's vs_decoder), its sequence's first element in a layer's cache tensor and its
    block table's offset; then the block tables, the block size and the element stride between kv heads."""
    k0 = cache.k[0]  # type: ignore[attr-defined]
    pos: list[int] = []
    rpos: list[int] = []
    hi: list[int] = []
    anc: list[int] = []
    base: list[int] = []
    toff: list[int] = []
    tables: list[int] = []
    paged = hasattr(cache, "table")
    for s in segments:
        off = len(tables)
        if paged:
            tables.extend(cache.table(s.slot))  # type: ignore[attr-defined]
        else:
            tables.append(0)
        pos.extend(range(s.start, s.start + s.length))
        if s.tree is None:
            rpos.extend(range(s.start, s.start + s.length))
            hi.extend(range(s.start + 1, s.start + s.length + 1))
            anc.extend([0] * s.length)
        else:
            rpos.extend(s.start + d for d in depths(s.tree))
            hi.extend([s.start] * s.length)
            anc.extend(sum(1 << b for b, seen in enumerate(row) if seen) for row in ancestor_mask(s.tree).tolist())
        base.extend([0 if paged else s.slot * k0.stride(0)] * s.length)
        toff.extend([off] * s.length)
    bs = cache.block_size if paged else k0.shape[2]  # type: ignore[attr-defined]
    return (_array(_i64, pos), _array(_i64, rpos), _array(_i64, hi), _array(_u64, anc), _array(_i64, base),
            _array(_i64, toff), _array(_i32, tables or [0]), bs, k0.stride(1))

