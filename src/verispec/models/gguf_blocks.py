"""GGUF weight formats: a tensor's raw Q4_0 / Q4_1 / Q8_0 blocks, unpacked as they are stored; and the raw rows of
every block format verispec's CPU kernel runs (`KERNEL_FORMATS`: those three, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, repacked
by kernels/kquant.py).

Every format here groups 32 consecutive elements of a row (along K, the input dimension) into one block:
  Q4_0: fp16 d, 16 bytes of nibbles          w = (q - 8) * d        q in 0..15
  Q4_1: fp16 d, fp16 m, 16 bytes of nibbles   w = q * d + m          q in 0..15
  Q8_0: fp16 d, 32 int8                       w = q * d              q in -128..127
Within a block's 16 nibble bytes, element j < 16 is the low nibble of byte j and element j >= 16 the high nibble
of byte j - 16. GGUF lists a tensor's dimensions innermost first (ne = [K, N]); `Blocks` holds the logical
[N, K] layout, which is HF's [out, in] for a linear weight. `Blocks.dequantize` uses gguf's own fp32 arithmetic,
so it equals `gguf.quants.dequantize` bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES

from verispec.kernels.cpu_build import KINDS
from verispec.models.gguf_index import GGUFIndex

BLOCK = 32  # elements per block, along K
# format name -> (bytes per block, whether the block stores a min m after d)
FORMATS: dict[str, tuple[int, bool]] = {"Q4_0": (18, False), "Q4_1": (20, True), "Q8_0": (34, False)}
# every format verispec's CPU kernel runs natively -> (elements, bytes) per block, as GGML defines them
KERNEL_FORMATS: dict[str, tuple[int, int]] = {k: GGML_QUANT_SIZES[GGMLQuantizationType[k]] for k in KINDS}


def bits_per_weight(kind: str) -> float:
    """A GGML type's stored bits per weight (F32 32, Q4_K 4.5, ...)."""
    elems, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return 8 * size / elems


@dataclass(frozen=True)
class Blocks:
    """One quantised [N, K] weight: per-element quants and per-block scales (and mins), as stored."""

    kind: str  # "Q4_0", "Q4_1" or "Q8_0"
    q: np.ndarray  # [N, K] uint8 in 0..15 (Q4_0, Q4_1) or int8 (Q8_0)
    scale: np.ndarray  # [N, K / 32] float16: each block's d
    min: np.ndarray | None  # [N, K / 32] float16: each block's m (Q4_1), else None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, computed as gguf does (fp32 scale times fp32 quant, then plus the fp32 min)."""
        n, k = self.shape
        d = self.scale.astype(np.float32)[:, :, None]  # [N, K/32, 1]
        q = self.q.reshape(n, k // BLOCK, BLOCK)  # [N, K/32, 32]
        if self.kind == "Q4_0":
            w = d * (q.astype(np.int8) - np.int8(8)).astype(np.float32)
        elif self.kind == "Q4_1":
            w = d * q.astype(np.float32) + self.min.astype(np.float32)[:, :, None]  # type: ignore[union-attr]
        else:
            w = q.astype(np.float32) * d
        return w.reshape(n, k)

    def take_rows(self, rows: np.ndarray) -> Blocks:
        """The weight with its output rows reordered (rows: [N'] indices): blocks run along K, so this is exact."""
        m = None if self.min is None else self.min[rows]
        return Blocks(self.kind, self.q[rows], self.scale[rows], m)


def unpack(raw: np.ndarray, kind: str) -> Blocks:
    """raw: uint8 [N, K / 32 * bytes per block], one row of blocks per output row -> its `Blocks`."""
    if kind not in FORMATS:
        raise ValueError(f"unsupported block format {kind!r}; supported: {', '.join(FORMATS)}")
    size, has_min = FORMATS[kind]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"{kind}: rows of {raw.shape[1:]} bytes are not whole {size}-byte blocks")
    b = raw.reshape(n, -1, size)  # [N, K/32, bytes per block]
    d = b[:, :, 0:2].copy().view(np.float16)[:, :, 0]  # [N, K/32]
    m = b[:, :, 2:4].copy().view(np.float16)[:, :, 0] if has_min else None
    body = b[:, :, 4 if has_min else 2 :]  # [N, K/32, 16] nibble bytes or [N, K/32, 32] int8
    if kind == "Q8_0":
        q = body.copy().view(np.int8)  # [N, K/32, 32]
    else:
        q = np.concatenate([body & 0x0F, body >> 4], axis=-1)  # [N, K/32, 32]: low nibbles first
    return Blocks(kind, q.reshape(n, -1), d, m)


def tensor_kind(source: GGUFReader | GGUFIndex | str | os.PathLike, name: str) -> str:
    """The GGML type name of tensor `name` ("Q4_1", "F32", ...). `source`: an open reader, an index, or a path
    (read through its cached index, models/gguf_index.py)."""
    if isinstance(source, GGUFReader):
        return GGMLQuantizationType(_tensor(source, name).tensor_type).name
    return _index(source).entry(name).kind


def raw_rows(source: GGUFReader | GGUFIndex | str | os.PathLike, name: str) -> tuple[np.ndarray, str, int]:
    """Tensor `name` of a GGUF file as stored: (uint8 [N, K / block * block bytes] rows of blocks, its GGML type
    name, K). Only for the formats verispec's kernel runs (KERNEL_FORMATS). From an index, the bytes are read into
    memory of their own (no map of the file stays behind once the caller drops them)."""
    if isinstance(source, GGUFReader):
        t = _tensor(source, name)
        kind, shape, data = GGMLQuantizationType(t.tensor_type).name, tuple(int(x) for x in t.shape), t.data
    else:
        index = _index(source)
        e = index.entry(name)
        kind, shape, data = e.kind, e.shape, index.read(name) if e.kind in KERNEL_FORMATS else None
    if kind not in KERNEL_FORMATS:
        raise ValueError(f"{name} is {kind}; block formats: {', '.join(KERNEL_FORMATS)}")
    k = shape[0]  # GGUF's ne: innermost (K) first
    n = int(np.prod(shape[1:]))
    return np.asarray(data).reshape(n, -1), kind, k


def read_blocks(source: GGUFReader | GGUFIndex | str | os.PathLike, name: str) -> Blocks:
    """Tensor `name` of a GGUF file (a path, an index or an open reader) as `Blocks` in its logical [N, K] layout."""
    raw, kind, k = raw_rows(source, name)
    blocks = unpack(raw, kind)
    if blocks.shape != (raw.shape[0], k):
        raise ValueError(f"{name}: unpacked {blocks.shape}, expected {(raw.shape[0], k)}")
    return blocks


def _index(source: GGUFIndex | str | os.PathLike) -> GGUFIndex:
    return source if isinstance(source, GGUFIndex) else GGUFIndex.open(source)


def _tensor(reader: GGUFReader, name: str):
    for t in reader.tensors:
        if t.name == name:
            return t
    raise KeyError(f"GGUF file has no tensor {name!r}")
