"""The token embedding of a GGUF model kept in the file's own format: only the rows a forward looks up are
dequantised (gguf's own `gguf.quants.dequantize`, so a row is bit for bit what the dense loader would have held in
float32), then rounded to the model's dtype. No dense [V, d] table is held.

Where the rows come from:
- `held`: the tensor's raw rows (uint8 [V, row bytes]) in a buffer of the module: an untied embedding, whose
  bytes nothing else holds;
- `from_file`: read from the GGUF file at each lookup (one `os.pread` per row; the page cache, not the process,
  keeps them): a head tied to the embedding already holds these rows, repacked for its kernel, so a second full
  copy in memory is avoided. The file's size and modification time are checked at each read.

A decode step looks up one token, and gguf's dequantisation of one row costs 60-90 us in numpy's machinery (more
than the row's arithmetic): the rows of small lookups are kept, least recently used first out, in CACHE_BYTES of
the model's dtype. They are the same values a fresh dequantisation gives, so the cache changes no output.

`dense()` builds the whole [V, d] table in the model's dtype, for the drafters that read the target's embedding
as a tensor (models/llama.py builds it on first access to `LlamaModel.embed`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

CHUNK_ROWS = 4096  # rows dequantised per step of `dense()`: bounds its float32 scratch
CACHE_BYTES = 8 * 2**20  # dequantised rows kept for small lookups (decode steps)
CACHED_LOOKUP = 16  # lookups of at most this many ids go through the cache; prefill chunks do not


class GGUFEmbedding(nn.Module):
    """Embedding lookup on a GGUF tensor's rows: `forward(ids [N]) -> [N, d]` in `dtype`."""

    def __init__(self, kind: str, vocab: int, dim: int, row_bytes: int, dtype: torch.dtype,
                 raw: np.ndarray | None = None, file: tuple[str | os.PathLike, int] | None = None) -> None:
        """kind: the GGML type name ("Q4_1", "Q6_K", "F16", ...); raw: uint8 [vocab, row_bytes] rows held here;
        or file: (GGUF path, byte offset of the tensor's data) to read rows from at each lookup."""
        super().__init__()
        if (raw is None) == (file is None):
            raise ValueError("GGUFEmbedding takes its rows either held (raw) or from the file, not both")
        self.kind, self.qtype = kind, GGMLQuantizationType[kind]
        self.vocab, self.dim, self.row_bytes, self.dtype = vocab, dim, row_bytes, dtype
        if raw is not None:
            raw = np.ascontiguousarray(raw, dtype=np.uint8)
            if raw.shape != (vocab, row_bytes):
                raise ValueError(f"embedding rows {raw.shape}, expected {(vocab, row_bytes)}")
            self.register_buffer("raw", torch.from_numpy(raw), persistent=False)
            self.file: tuple[Path, int, int, int] | None = None
        else:
            path = Path(file[0]).resolve()  # type: ignore[index]
            st = path.stat()
            self.raw = None
            self.file = (path, int(file[1]), st.st_size, st.st_mtime_ns)  # type: ignore[index]
        self._kept: OrderedDict[int, torch.Tensor] = OrderedDict()  # token id -> [d] row in dtype, LRU order
        self._keep = max(1, CACHE_BYTES // (dim * dtype.itemsize))

    @classmethod
    def held(cls, raw: np.ndarray, kind: str, dim: int, dtype: torch.dtype) -> GGUFEmbedding:
        return cls(kind, raw.shape[0], dim, raw.shape[1], dtype, raw=raw)

    @classmethod
    def from_file(cls, path: str | os.PathLike, offset: int, kind: str, vocab: int, dim: int, row_bytes: int,
                  dtype: torch.dtype) -> GGUFEmbedding:
        return cls(kind, vocab, dim, row_bytes, dtype, file=(path, offset))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """ids: int [N] in 0..vocab-1 -> their raw rows, uint8 [N, row bytes]."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab):
            raise IndexError(f"token id out of range 0..{self.vocab - 1}")
        if self.raw is not None:
            return self.raw.numpy()[ids]
        path, offset, size, mtime = self.file  # type: ignore[misc]
        out = np.empty((ids.size, self.row_bytes), np.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if (st.st_size, st.st_mtime_ns) != (size, mtime):
                raise RuntimeError(f"{path} changed on disk since the model was loaded; load it again")
            runs = [(0, ids.size)] if ids.size > 1 and np.all(np.diff(ids) == 1) else [(j, 1) for j in range(ids.size)]
            for j, n in runs:  # one read for a run of consecutive rows (`dense`), else one per row
                want = n * self.row_bytes
                got = os.pread(fd, want, offset + int(ids[j]) * self.row_bytes)
                if len(got) != want:
                    raise RuntimeError(f"{path}: embedding row {int(ids[j])} is cut short")
                out[j : j + n] = np.frombuffer(got, np.uint8).reshape(n, self.row_bytes)
        finally:
            os.close(fd)
        return out

    def dequantize_rows(self, ids: np.ndarray) -> np.ndarray:
        """ids: int [N] -> float32 [N, d], gguf's dequantisation of those rows."""
        return dequantize(self.rows(ids), self.qtype).reshape(ids.size, self.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [N] token ids -> [N, d] in the model's dtype."""
        flat = ids.reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        if flat.size > CACHED_LOOKUP:
            out = torch.from_numpy(self.dequantize_rows(flat)).to(self.dtype)
        else:
            out = self._cached(flat)
        return out.view(*ids.shape, self.dim)

    def _cached(self, flat: np.ndarray) -> torch.Tensor:
        """[N, d] rows of a small lookup through the kept rows (the missing ones dequantised together)."""
        kept, ids = self._kept, flat.tolist()
        got = {t: kept[t] for t in ids if t in kept}
        for t in got:
            kept.move_to_end(t)
        miss = sorted(set(ids) - got.keys())
        if miss:
            fresh = torch.from_numpy(self.dequantize_rows(np.array(miss, np.int64))).to(self.dtype)
            for t, row in zip(miss, fresh):
                got[t] = kept[t] = row.clone()
            while len(kept) > self._keep:
                kept.popitem(last=False)
        return torch.stack([got[t] for t in ids])

    def dense(self) -> torch.Tensor:
        """The whole table [V, d] in the model's dtype (what a dense loader holds)."""
        out = torch.empty(self.vocab, self.dim, dtype=self.dtype)
        for start in range(0, self.vocab, CHUNK_ROWS):
            ids = np.arange(start, min(start + CHUNK_ROWS, self.vocab))
            out[start : start + ids.size] = torch.from_numpy(self.dequantize_rows(ids))
        return out

    def extra_repr(self) -> str:
        where = "held" if self.raw is not None else "read from the file"
        return f"vocab={self.vocab}, dim={self.dim}, kind={self.kind}, rows {where}, dtype={self.dtype}"
