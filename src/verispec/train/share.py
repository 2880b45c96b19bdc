"""Which sequences a training rank reads: a catalog of the data from the shard headers, one held-out split that
does not depend on the number of ranks, and each rank loading only its own share (rows sliced from the shards,
only the layers its drafter reads, in bf16)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import torch
from safetensors import safe_open

from verispec.train.distributed import Dist
from verispec.train.shards import TrainSequence, read_meta, shard_name

T = TypeVar("T")


@dataclass(frozen=True)
class SeqRef:
    """Where one sequence lives: rows start:end of shard `shard`, the first `prompt_len` of them the prompt."""

    shard: int
    index: int
    start: int
    end: int
    prompt_len: int

    @property
    def length(self) -> int:
        return self.end - self.start


def catalog(data_dir: str | Path) -> list[SeqRef]:
    """Every sequence of the finished shards, read from the small offset tensors only."""
    refs = []
    for i in read_meta(data_dir)["shards"]:
        with safe_open(str(Path(data_dir) / shard_name(i)), framework="pt") as f:
            off, plen = f.get_tensor("seq_offsets").tolist(), f.get_tensor("prompt_lens").tolist()
        refs += [SeqRef(i, s, off[s], off[s + 1], int(plen[s])) for s in range(len(plen))]
    return refs


def response_counts(data_dir: str | Path, vocab_size: int) -> torch.Tensor:
    """[vocab_size] how often each token occurs in the responses of a data directory (token ids read, no states)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in read_meta(data_dir)["shards"]:
        with safe_open(str(Path(data_dir) / shard_name(i)), framework="pt") as f:
            ids, off = f.get_tensor("input_ids").long(), f.get_tensor("seq_offsets").tolist()
            plen = f.get_tensor("prompt_lens").tolist()
        for s in range(len(plen)):
            r = ids[off[s] + int(plen[s]) : off[s + 1]]
            if r.numel() and int(r.max()) >= vocab_size:
                raise ValueError(f"{data_dir} holds token {int(r.max())}, outside a vocabulary of {vocab_size}: "
                                 "data of another target")
            counts += torch.bincount(r, minlength=vocab_size)
    return counts


def load(data_dir: str | Path, refs: Sequence[SeqRef], layers: Sequence[int]) -> list[TrainSequence]:
    """The sequences `refs` (in that order) with hidden states of `layers` and the last hidden state, bf16."""
    by_shard: dict[int, list[int]] = {}
    for k, r in enumerate(refs):
        by_shard.setdefault(r.shard, []).append(k)
    out: list[TrainSequence | None] = [None] * len(refs)
    for shard, ks in by_shard.items():
        with safe_open(str(Path(data_dir) / shard_name(shard)), framework="pt") as f:
            missing = sorted(set(layers) - {int(n.split(".")[1]) for n in f.keys() if n.startswith("hidden.")})
            if missing:
                raise ValueError(f"{data_dir} has no hidden states for target layers {missing}; regenerate it with "
                                 "`verispec train data --layers` including them")
            ids, last = f.get_slice("input_ids"), f.get_slice("last_hidden")
            hid = {i: f.get_slice(f"hidden.{i}") for i in set(layers)}
            for k in ks:
                a, b = refs[k].start, refs[k].end
                out[k] = TrainSequence(ids[a:b].long(), refs[k].prompt_len,
                                       {i: h[a:b].bfloat16() for i, h in hid.items()}, last[a:b].bfloat16())
    return out  # type: ignore[return-value]


def split(refs: Sequence[T], frac: float, seed: int) -> tuple[list[T], list[T]]:
    """(train, held-out) of sequences or their refs: a seeded permutation, round(frac * n) held out (at least one
    of each)."""
    if len(refs) < 2:
        raise ValueError(f"need at least 2 usable sequences, got {len(refs)}; generate more with `verispec train data`")
    order = torch.randperm(len(refs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = min(len(refs) - 1, max(1, round(frac * len(refs))))
    return [refs[i] for i in order[n_held:]], [refs[i] for i in order[:n_held]]


@dataclass(frozen=True)
class RankData:
    train: list[TrainSequence]  # this rank's training sequences
    held: list[TrainSequence]  # this rank's share of the held-out sequences (possibly empty)
    train_total: int  # over all ranks
    held_total: int


def rank_data(data_dir: str | Path, dist: Dist, layers: Sequence[int], frac: float, seed: int,
              usable: Callable[[SeqRef], bool] = lambda r: True) -> RankData:
    """Catalog, keep the usable sequences, split train / held-out the same way whatever the world size, and load
    this rank's share of each (train[rank::world], held[rank::world])."""
    refs = [r for r in catalog(data_dir) if usable(r)]
    train, held = split(refs, frac, seed)
    if len(train) < dist.world:
        raise ValueError(f"{len(train)} training sequences cannot feed {dist.world} ranks; generate more data or "
                         "launch fewer processes")
    return RankData(load(data_dir, dist.share(train), layers), load(data_dir, dist.share(held), layers),
                    len(train), len(held))
