"""EAGLE-3's soft labels kept on disk beside the data, so a resumed or repeated run does not project every
response position through the vocabulary again (11.7 min for 6,348 sequences of the 1M-token set on 2 cores).

The cache is keyed by content, not by paths: the target's output matrix, the label width, the sequence cut, every
sequence's token ids and prompt length in order, and the final hidden states of the first and last sequence (which
catch data regenerated with the same tokens on another target path). Any change gives another key, so a stale file
is never read; a data directory that cannot be written to only costs the cache, with a warning."""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from verispec.train.shards import TrainSequence

CACHE_DIR = "cache"


def label_key(seqs: list[TrainSequence], out_w: torch.Tensor, topk: int, max_len: int) -> str:
    """A digest of everything the labels of `seqs` depend on (see the module docstring)."""
    h = hashlib.sha256(f"eagle3-soft-labels topk={topk} max_len={max_len} n={len(seqs)}".encode())
    h.update(out_w.detach().float().cpu().contiguous().numpy().tobytes())
    for s in seqs:
        h.update(s.ids.to(torch.int64).numpy().tobytes())
        h.update(int(s.prompt_len).to_bytes(8, "little"))
    for s in (seqs[:1] + seqs[-1:]) if seqs else []:
        h.update(s.last_hidden.float().contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


def cached_labels(seqs: list[TrainSequence], out_w: torch.Tensor, topk: int, max_len: int,
                  data_dir: str | Path | None, compute: Callable[[TrainSequence], tuple[torch.Tensor, torch.Tensor]],
                  progress: bool = False) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
    """Each sequence's (ids [T, topk], probs [T, topk]) labels, from the cache file under data_dir when one matches,
    else from `compute` (then written there). Returns (labels, whether they came from the cache)."""
    path = None
    if data_dir is not None:
        path = Path(data_dir) / CACHE_DIR / f"eagle3-soft-labels-{label_key(seqs, out_w, topk, max_len)}.safetensors"
    if path is not None and path.exists():
        t = load_file(str(path))
        off = t["offsets"].tolist()
        return [(t["ids"][a:b].long(), t["probs"][a:b]) for a, b in zip(off[:-1], off[1:])], True
    labels = [compute(s) for s in tqdm(seqs, desc="soft labels", unit="seq", disable=not progress)]
    if path is not None:
        _write(path, labels)
    return labels, False


def _write(path: Path, labels: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One safetensors file (rows of all sequences concatenated, offsets [n + 1]), written atomically."""
    off = [0]
    for ids, _ in labels:
        off.append(off[-1] + ids.shape[0])
    tensors = {"offsets": torch.tensor(off, dtype=torch.int64),
               "ids": torch.cat([i for i, _ in labels]).to(torch.int32).contiguous() if labels else torch.zeros(0, 1),
               "probs": torch.cat([p for _, p in labels]).float().contiguous() if labels else torch.zeros(0, 1)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two runs writing the same labels do not collide
        save_file(tensors, str(tmp))
        tmp.replace(path)
    except OSError as e:
        warnings.warn(f"soft labels not cached ({e}); the next run computes them again", stacklevel=2)
