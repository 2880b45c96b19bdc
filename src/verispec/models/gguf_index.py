"""A GGUF file's tensor table (name -> GGML type, shape, byte range) and architecture, read once and cached.

`gguf.GGUFReader` parses every metadata field on open, the tokenizer's 49k-entry arrays included: about 10 s for
the default model on a 2-core machine, paid on every load that looks at the file's tensors. The table is all the
loaders need, so it is parsed once per file (same path, size and modification time) and kept as JSON under the
verispec cache; tensor bytes are then read at their offsets (`data`: a memory map; `read`: into memory of their
own). `GGUFIndex.open` also keeps one index per file in the process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VERSION = 1


@dataclass(frozen=True)
class TensorEntry:
    kind: str  # GGML type name: "Q4_1", "F32", ...
    shape: tuple[int, ...]  # GGUF's ne: innermost (K) first
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class FileRows:
    """Rows [lo, hi) of a tensor stored at `offset` in `path`, `row_bytes` each, read into memory of their own."""

    path: Path
    offset: int
    n: int
    row_bytes: int
    ndim: int = 2

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.row_bytes

    def rows(self, lo: int, hi: int) -> np.ndarray:
        data = read_bytes(self.path, self.offset + lo * self.row_bytes, (hi - lo) * self.row_bytes, f"rows {lo}..{hi}")
        return data.reshape(hi - lo, self.row_bytes)


def read_bytes(path: Path, offset: int, count: int, what: str) -> np.ndarray:
    """uint8 [count] of `path` from `offset`, read into memory of their own (no map of the file stays behind);
    `what` names them in the error where the file is cut short."""
    out = np.fromfile(path, dtype=np.uint8, count=count, offset=offset)
    if out.size != count:
        raise ValueError(f"{path}: {what} is cut short ({out.size} of {count} bytes)")
    return out


@dataclass(frozen=True)
class GGUFIndex:
    path: Path
    arch: str  # general.architecture ("llama", "qwen2", ...) or ""
    tensors: dict[str, TensorEntry]

    @classmethod
    def open(cls, path: str | os.PathLike, cache: Path | None = None) -> GGUFIndex:
        """The file's index: from this process's memory, the cache, or parsed now (and cached)."""
        p = Path(path).resolve()
        st = p.stat()
        return _open(str(p), st.st_size, st.st_mtime_ns, None if cache is None else str(cache))

    def entry(self, name: str) -> TensorEntry:
        if name not in self.tensors:
            raise KeyError(f"GGUF file has no tensor {name!r}")
        return self.tensors[name]

    def data(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored: uint8 [nbytes], a read-only memory map."""
        e = self.entry(name)
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=e.offset, shape=(e.nbytes,))

    def row_source(self, name: str) -> FileRows:
        """The tensor's rows of blocks ([N, bytes per row], N = all but its innermost dimension), read from the file
        only when asked, some rows at a time (kernels/q8act.py's `RowSource`)."""
        e = self.entry(name)
        n = int(np.prod(e.shape[1:]))
        return FileRows(self.path, e.offset, n, e.nbytes // n)

    def read(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, read into memory of their own: uint8 [nbytes] (no map of the file stays
        behind, so a loader that repacks tensor by tensor holds one tensor's bytes at a time)."""
        e = self.entry(name)
        return read_bytes(self.path, e.offset, e.nbytes, f"tensor {name}")


@functools.lru_cache(maxsize=8)
def _open(path: str, size: int, mtime_ns: int, cache: str | None) -> GGUFIndex:
    key = hashlib.sha256(f"{path}|{size}|{mtime_ns}|{VERSION}".encode()).hexdigest()[:24]
    if cache is None:
        from verispec.config import cache_dir

        cache = str(cache_dir())
    file = Path(cache) / "gguf-index" / f"{key}.json"
    if file.exists():
        raw = json.loads(file.read_text())
        return GGUFIndex(Path(path), raw["arch"], {n: TensorEntry(e[0], tuple(e[1]), e[2], e[3])
                                                   for n, e in raw["tensors"].items()})
    index = _parse(Path(path))
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"arch": index.arch, "tensors": {
            n: [e.kind, list(e.shape), e.offset, e.nbytes] for n, e in index.tensors.items()}}))
        tmp.replace(file)
    except OSError:  # a read-only cache: the index still serves this process
        pass
    return index


def _parse(path: Path) -> GGUFIndex:
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = "" if field is None else bytes(field.parts[field.data[0]]).decode()
    tensors = {t.name: TensorEntry(GGMLQuantizationType(t.tensor_type).name, tuple(int(x) for x in t.shape),
                                   int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
    return GGUFIndex(path, arch, tensors)
