"""The process group a training run lives in: one process, or one rank of a `torchrun` launch.

torchrun exports RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; `Dist.from_env` joins that group
(gloo on CPU, nccl on CUDA, each rank on its own GPU). Without them the run is one process and every collective
below is the identity, so the training code has a single path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as tdist

T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world, (self.rank, self.world)

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes checkpoints, logs and the progress bar; the others only compute."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @classmethod
    def single(cls, device: str | torch.device | None = None) -> "Dist":
        return cls(0, 1, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")))

    @classmethod
    def from_env(cls, device: str | None = None) -> "Dist":
        """Join the torchrun group if there is one (idempotent); otherwise a single process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls.single(device)
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        kind = torch.device(device).type if device else ("cuda" if torch.cuda.is_available() else "cpu")
        if kind == "cuda":
            if local >= torch.cuda.device_count():
                raise ValueError(f"local rank {local} has no GPU ({torch.cuda.device_count()} visible): launch "
                                 "torchrun with --nproc-per-node at most the number of GPUs")
            torch.cuda.set_device(local)
            dev = torch.device("cuda", local)
        else:
            dev = torch.device("cpu")
        if not tdist.is_initialized():
            tdist.init_process_group("nccl" if kind == "cuda" else "gloo")
        return cls(rank, world, dev)

    # ---- collectives (identity for one process) ---------------------------------------------------------
    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (float64 on the wire)."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self._wire)
        if self.active:
            tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
        return t.tolist()

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self._wire)
        if self.active:
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return float(t[0])

    def gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank (pickled; for small things only)."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        tdist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.active:
            tdist.barrier()

    def close(self) -> None:
        if self.active and tdist.is_initialized():
            tdist.destroy_process_group()

    @property
    def _wire(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's share of a list every rank holds in the same order: items rank, rank + world, ..."""
        return list(items[self.rank :: self.world])
