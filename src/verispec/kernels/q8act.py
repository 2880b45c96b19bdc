"""A kernel path: a GGUF file's own weight blocks (Q4_0, Q4_1, Q8_0, and repacked exactly by kernels/kquant.py Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) times activations quantised to int8 per block of 32, on verispec's own CPU
kernel (csrc/cpu.c, built by kernels/cpu_build.py). This is the arithmetic llama.cpp runs on a CPU: the weights
are exactly the file's, the activations are rounded to 8 bits with one scale per 32 values of a row (llama.cpp
rounds per 256 against K-quants: see kernels/kquant.py), and the products are summed in integers. A row's result
depends on that row alone (per-row, per-block scales; a fixed order per output), so it is batch-invariant by
construction.

The blocks are kept byte for byte; only their order changes: eight output rows are interleaved per block
("x8" tiles, see the C source) so that one vector's lanes are eight outputs. A weight may stack parts of different
formats along N (a mixed file's q, k, v): each part runs on its own blocks.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch
from torch import nn

from verispec.kernels import kquant
from verispec.kernels.cpu_build import KINDS
from verispec.kernels.cpu_kernels import load

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # GGUF's block sizes
# every format the kernel runs -> (elements, bytes) of its file blocks
FILE_BLOCKS: dict[str, tuple[int, int]] = {**{k: (BLOCK, b) for k, b in BLOCK_BYTES.items()}, **kquant.FILE_BLOCKS}
ROWS = 8  # output rows interleaved per tile


def tile_rows(raw: np.ndarray, kind: str) -> np.ndarray:
    """raw: uint8 [N, K/32 * block bytes], GGUF's blocks row by row -> x8 tiles [ceil(N/8), K/32, tile bytes]:
    per tile the 8 rows' d (fp16 x 8), then m (Q4_1), then the quants in 8 groups of [row][4 bytes] (for 4-bit
    weights, groups of nibble bytes 4g..4g+3, g < 4). Rows past N are zero."""
    size = BLOCK_BYTES[kind]
    n, width = raw.shape
    if width % size:
        raise ValueError(f"{kind}: rows of {width} bytes are not whole {size}-byte blocks")
    nb = width // size
    padded = np.zeros((-(-n // ROWS) * ROWS, width), np.uint8)
    padded[:n] = raw
    b = padded.reshape(-1, ROWS, nb, size).transpose(0, 2, 1, 3)  # [G, nb, 8, size]
    lead = [b[..., 0:2].reshape(*b.shape[:2], 2 * ROWS)]
    if kind == "Q4_1":
        lead.append(b[..., 2:4].reshape(*b.shape[:2], 2 * ROWS))
    qs = b[..., 4 if kind == "Q4_1" else 2 :]  # [G, nb, 8, 16 or 32]
    groups = qs.shape[-1] // 4
    quants = qs.reshape(*b.shape[:2], ROWS, groups, 4).transpose(0, 1, 3, 2, 4).reshape(*b.shape[:2], -1)
    return np.ascontiguousarray(np.concatenate([*lead, quants], -1))


PACK_ROWS = 8192  # rows repacked at a time at most: a 150k-row head's intermediates stay tens of MB, not its size
PACK_VALUES = 1 << 21  # and weights at a time at most: decoding holds several bytes per weight (a K-quant's values,
# scales and masks), so 8,192 rows of 1,536 took about 100 MB above the tiles while a 1.5B model's head was packed


class RowSource(Protocol):
    """Rows of blocks read on demand (a GGUF tensor in its file: models/gguf_index.py's `FileRows`), so that a large
    weight is repacked without its raw bytes all in memory at once."""

    shape: tuple[int, int]
    ndim: int

    def rows(self, lo: int, hi: int) -> np.ndarray: ...


def _rows(raw: np.ndarray | torch.Tensor | RowSource, lo: int, hi: int) -> np.ndarray:
    return raw.rows(lo, hi) if hasattr(raw, "rows") else np.asarray(raw[lo:hi], np.uint8)


def pack_rows(raw: np.ndarray | RowSource, kind: str) -> np.ndarray:
    """`tile_rows` (Q4_0, Q4_1, Q8_0) or `kquant.pack` (the others) of raw [N, row bytes], a piece of rows at a
    time (a multiple of 8, bounded by PACK_ROWS and PACK_VALUES) into one array: each group of 8 rows packs
    alone, so the pieces are the whole's slices, and the decoding's intermediates are a piece's size, not the
    weight's."""
    one = tile_rows if kind in BLOCK_BYTES else kquant.pack
    n = raw.shape[0]
    elems, size = FILE_BLOCKS[kind]
    step = min(PACK_ROWS, max(ROWS, PACK_VALUES // (raw.shape[1] // size * elems) // ROWS * ROWS))
    if n <= step:
        return one(_rows(raw, 0, n), kind)
    first = one(_rows(raw, 0, step), kind)
    out = np.empty((-(-n // ROWS), *first.shape[1:]), np.uint8)
    out[: step // ROWS] = first
    for lo in range(step, n, step):
        piece = one(_rows(raw, lo, min(n, lo + step)), kind)
        out[lo // ROWS : lo // ROWS + piece.shape[0]] = piece
    return out


class Q8ActWeight(nn.Module):
    """An [N, K] weight in GGUF blocks, multiplied with int8-quantised activations: `matmul(x [M, K]) -> [M, N]`
    in x's dtype (float32 or bfloat16). An `nn.Module` with one uint8 buffer, so it stands where a layer had a
    weight parameter. It takes its input's RMSNorm or SwiGLU and the residual into the call (`fuses_norm`, see
    models/llama.py's `_norm_linear` and `Layer.feed_forward`), with its own arithmetic for those."""

    fuses_norm = True

    def __init__(self, raw: np.ndarray | torch.Tensor | RowSource, kind: str, n: int, k: int,
                 more: Sequence[tuple[np.ndarray, str]] = ()) -> None:
        """raw: uint8 [N, K / block * block bytes], the GGUF tensor's rows (already in the model's row order), in
        format `kind`, or a `RowSource` of them (read piece by piece while repacking); `more`: further (raw rows,
        kind) parts stacked below it along N (see `stacked`)."""
        super().__init__()
        first = raw if hasattr(raw, "rows") and not more else _rows(raw, 0, raw.shape[0])  # a RowSource: unread
        parts = [(first, kind)] + [(np.asarray(r, np.uint8), f) for r, f in more]
        for i, (r, f) in enumerate(parts):
            if f not in KINDS:
                raise ValueError(f"unsupported block format {f!r}; supported: {', '.join(KINDS)}")
            elems, size = FILE_BLOCKS[f]
            if k % elems or r.ndim != 2 or r.shape[1] != k // elems * size or (i == 0 and r.shape[0] != n):
                raise ValueError(f"{f} weight [{n if i == 0 else '?'}, {k}]: got raw rows {r.shape}")
        # consecutive parts of one format run as one
        merged: list[tuple[np.ndarray, str]] = []
        for r, f in parts:
            merged[-1:] = [(np.concatenate([merged[-1][0], r]), f)] if merged and merged[-1][1] == f else [
                *merged[-1:], (r, f)]
        tiles = [pack_rows(r, f) for r, f in merged]
        offsets = np.cumsum([0] + [t.nbytes for t in tiles])
        self.kind = "+".join(f for _, f in merged)
        self.n, self.k = sum(r.shape[0] for r, _ in merged), k
        load()  # built (or found) now, so a missing compiler fails at load time, not mid-forward
        packed = tiles[0] if len(tiles) == 1 else np.concatenate([t.reshape(-1) for t in tiles])
        self.register_buffer("tiles", torch.from_numpy(packed))
        self.register_buffer("layout", torch.tensor([[KINDS[f], r.shape[0], int(o)] for (r, f), o in
                                                     zip(merged, offsets)], dtype=torch.int64))

    @classmethod
    def stacked(cls, parts: Sequence[tuple[np.ndarray, str]], k: int) -> Q8ActWeight:
        """Weights stacked along N (e.g. q, k, v): parts of (raw rows, kind), each running on its own format (the
        activations are quantised once for all of them)."""
        (first, kind), *more = [(np.asarray(r, np.uint8), f) for r, f in parts]
        return cls(first, kind, first.shape[0], k, more)

    @classmethod
    def from_float(cls, w: torch.Tensor, kind: str = "Q8_0") -> Q8ActWeight:
        """A float weight [N, K] (K a multiple of 32) rounded to `kind` blocks (Q8_0, Q4_1 or Q4_0) by gguf's own
        quantizer (llama.cpp's reference quantize_row_*): for weights that come as floats, e.g. a trained
        drafter's."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        n, k = w.shape
        if kind not in BLOCK_BYTES:
            raise ValueError(f"weight format {kind!r} is not one of {', '.join(BLOCK_BYTES)}")
        if k % BLOCK:
            raise ValueError(f"{kind} needs K a multiple of {BLOCK}, got [{n}, {k}]")
        raw = quantize(w.detach().float().cpu().numpy(), GGMLQuantizationType[kind])  # uint8 [N, K / 32 * bytes]
        return cls(raw, kind, n, k)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def matmul(self, x: torch.Tensor, reference: bool = False, norm: torch.Tensor | None = None, eps: float = 0.0,
               residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
        """x: [M, K] float32 / bfloat16 on CPU -> [M, N] in x's dtype. `norm` (float32 [K]): multiply
        RMSNorm(x; eps) * norm instead of x; `swiglu`: x is float32 [M, 2K] = [gate | up], multiply silu(gate) * up;
        `residual` (float32 [M, N], float32 x): return residual + the product. `reference`: the portable C body."""
        if x.device.type != "cpu":
            raise NotImplementedError("Q8ActWeight runs verispec's CPU kernel only")
        width = 2 * self.k if swiglu else self.k
        if x.dim() != 2 or x.shape[1] != width:
            raise ValueError(f"q8act matmul: x {tuple(x.shape)} does not match the weight {self.shape}"
                             f"{' (SwiGLU input: 2K wide)' if swiglu else ''}")
        if x.dtype is not torch.float32 and (swiglu or x.dtype is not torch.bfloat16):
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        if norm is not None and (swiglu or norm.dtype is not torch.float32 or norm.shape != (self.k,)):
            raise ValueError(f"q8act matmul: norm weights must be float32 [{self.k}], without swiglu")
        if residual is not None and (residual.dtype is not torch.float32 or x.dtype is not torch.float32
                                     or residual.shape != (x.shape[0], self.n) or not residual.is_contiguous()):
            raise ValueError(f"q8act matmul: the residual must be a contiguous float32 [{x.shape[0]}, {self.n}]")
        out = torch.empty(x.shape[0], self.n, dtype=x.dtype)
        load().linear(self.tiles, self.layout, self.n, self.k, x, out, reference, norm, eps, residual, swiglu)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """As nn.Linear: x [..., K] -> [..., N] (leading dimensions flattened into rows of `matmul`)."""
        if x.dim() == 2:
            return self.matmul(x)
        return self.matmul(x.reshape(-1, self.k)).view(*x.shape[:-1], self.n)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, kind={self.kind}, int8 activations per {BLOCK}"


def round_linears(module: nn.Module, names: Sequence[str], kind: str = "Q8_0") -> None:
    """Replace each named bias-free nn.Linear of `module` by its weight rounded to `kind` blocks
    (`Q8ActWeight.from_float`): a float drafter set up to run beside a gguf-q8act target on the same kernel."""
    for name in names:
        setattr(module, name, Q8ActWeight.from_float(getattr(module, name).weight, kind))
