"""The training-data format: sharded safetensors of target responses with their captured hidden states.

A data directory holds `meta.json` and `shard-NNNNN.safetensors` files. Each shard packs S sequences
(prompt + the target's own response) of T tokens in all:
  input_ids    int32 [T]       the tokens, sequences concatenated
  seq_offsets  int64 [S + 1]   sequence s is rows seq_offsets[s] : seq_offsets[s + 1]
  prompt_lens  int64 [S]       the first prompt_lens[s] tokens of a sequence are the prompt (no loss there)
  hidden.{i}   bf16  [T, d]    the target's hidden state ENTERING layer i at every position (i = L: last output)
  last_hidden  bf16  [T, d]    after the final norm: the target's logits at a position are last_hidden @ W_out^T
meta.json names the target, its layer count and hidden size, the captured layers, the prompt files and every
finished shard; a shard is written to a temporary name and renamed, so a resumed run redoes only missing ones.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file

META = "meta.json"


@dataclass(frozen=True)
class TrainSequence:
    ids: torch.Tensor  # [T] long
    prompt_len: int
    hidden: dict[int, torch.Tensor]  # layer -> [T, d] float32
    last_hidden: torch.Tensor  # [T, d] float32

    def features(self, layers: Sequence[int]) -> torch.Tensor:
        """[T, len(layers) d]: the drafter's feature rows (same order as `feature_layers`)."""
        missing = [i for i in layers if i not in self.hidden]
        if missing:
            raise ValueError(f"the data has no hidden states for target layers {missing}; regenerate it with "
                             f"`verispec train data --layers` including them")
        return torch.cat([self.hidden[i] for i in layers], dim=-1)


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def write_shard(path: Path, seqs: Sequence[tuple[list[int], int, dict[int, torch.Tensor], torch.Tensor]]) -> None:
    """seqs: (ids, prompt_len, {layer: [n, d]}, last_hidden [n, d]) per sequence. Atomic (tmp + rename)."""
    assert seqs, "a shard needs at least one sequence"
    layers = sorted(seqs[0][2])
    offsets = [0]
    for ids, *_ in seqs:
        offsets.append(offsets[-1] + len(ids))
    tensors = {
        "input_ids": torch.tensor([t for ids, *_ in seqs for t in ids], dtype=torch.int32),
        "seq_offsets": torch.tensor(offsets, dtype=torch.int64),
        "prompt_lens": torch.tensor([p for _, p, _, _ in seqs], dtype=torch.int64),
        "last_hidden": torch.cat([h for *_, h in seqs]).to(torch.bfloat16).contiguous(),
    }
    for i in layers:
        tensors[f"hidden.{i}"] = torch.cat([hid[i] for _, _, hid, _ in seqs]).to(torch.bfloat16).contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def read_meta(data_dir: str | Path) -> dict:
    p = Path(data_dir) / META
    if not p.exists():
        raise FileNotFoundError(f"{data_dir} holds no training data ({META} missing); run `verispec train data` first")
    return json.loads(p.read_text())


def write_meta(data_dir: str | Path, meta: dict) -> None:
    p = Path(data_dir) / META
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, p)


def link_shard(src: Path, dst: Path) -> None:
    """Put the shard file `src` at `dst` without copying its bytes where the file system allows (a hard link),
    else copied: joining data directories never duplicates gigabytes of states on one disk."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def iter_sequences(data_dir: str | Path, shards: Sequence[int] | None = None) -> Iterator[TrainSequence]:
    """Every sequence of the finished shards (or of the given shard indices), features as float32."""
    meta = read_meta(data_dir)
    for i in meta["shards"] if shards is None else shards:
        t = load_file(str(Path(data_dir) / shard_name(i)))
        off = t["seq_offsets"].tolist()
        layers = sorted(int(k.split(".")[1]) for k in t if k.startswith("hidden."))
        for s in range(len(off) - 1):
            a, b = off[s], off[s + 1]
            yield TrainSequence(
                ids=t["input_ids"][a:b].long(),
                prompt_len=int(t["prompt_lens"][s]),
                hidden={i: t[f"hidden.{i}"][a:b].float() for i in layers},
                last_hidden=t["last_hidden"][a:b].float(),
            )


def load_all(data_dir: str | Path) -> list[TrainSequence]:
    return list(iter_sequences(data_dir))


def target_logits(last_hidden: torch.Tensor, out_weight: torch.Tensor) -> torch.Tensor:
    """[T, V] float32 target logits from the stored post-norm states and the target's output matrix [V, d]."""
    return last_hidden.to(out_weight.dtype) @ out_weight.t()
