"""Resumable training state: `<out>/checkpoints/step-NNNNNNN/state.pt`, written by one rank, atomically (a
temporary directory renamed into place), the newest two kept. A state holds everything the next step depends on:
the weights, the optimizer's moments, the step, the time already spent, the log so far and every rank's data
generator, so a run killed and resumed continues exactly as if it had not stopped."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

KEEP = 2
STATE = "state.pt"


@dataclass(frozen=True)
class TrainState:
    step: int
    elapsed_s: float  # training time spent before this state (over all earlier sessions)
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    generators: list[torch.Tensor]  # per rank, in rank order
    log: dict[str, Any]
    world: int
    fingerprint: dict[str, Any]  # what must match to resume (method, data, config)


def directory(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def _name(step: int) -> str:
    return f"step-{step:07d}"


def save(out: str | Path, state: TrainState) -> Path:
    root = directory(out)
    root.mkdir(parents=True, exist_ok=True)
    final = root / _name(state.step)
    tmp = root / f".tmp-{_name(state.step)}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state.__dict__, tmp / STATE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(out: str | Path) -> Path | None:
    """The newest complete checkpoint (temporary directories of an interrupted save are ignored)."""
    root = directory(out)
    done = sorted(p for p in root.glob("step-*") if (p / STATE).exists()) if root.exists() else []
    return done[-1] if done else None


def load(path: str | Path, fingerprint: dict[str, Any], world: int) -> TrainState:
    raw = torch.load(Path(path) / STATE, map_location="cpu", weights_only=False)
    state = TrainState(**raw)
    if state.fingerprint != fingerprint:
        diff = sorted(k for k in set(state.fingerprint) | set(fingerprint)
                      if state.fingerprint.get(k) != fingerprint.get(k))
        raise ValueError(f"{path} was written by a different run (differs in {', '.join(diff)}); resume with the "
                         "same arguments, or pass --no-resume / another --out to start afresh")
    if state.world != world:
        raise ValueError(f"{path} was written by {state.world} ranks and this launch has {world}; resume with "
                         f"--nproc-per-node {state.world} (each rank's data order is part of the state)")
    return state
