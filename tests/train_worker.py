"""A torchrun worker for tests/test_train_distributed.py: runs `verispec train <method> ...` (the real command line)
on this rank and saves the rank's trainable weights before training and after every step to
$DUMP/rank{R}-step{S}.pt. With $KILL_AT_STEP set, rank 0 kills itself (SIGKILL, no cleanup) as soon as it has taken
that step, before that step's checkpoint is written: an interruption at an arbitrary point of a real run."""

from __future__ import annotations

import os
import signal
import sys

import torch

import verispec.train.dflash as dflash_train
import verispec.train.eagle3 as eagle3_train
from verispec.cli import main
from verispec.train import loop

DUMP = os.environ["DUMP"]
KILL_AT = int(os.environ.get("KILL_AT_STEP", "0"))
RANK = int(os.environ.get("RANK", "0"))


def dump(step: int, model: torch.nn.Module) -> None:
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.save(weights, os.path.join(DUMP, f"rank{RANK}-step{step}.pt"))


def on_step(step: int, model: torch.nn.Module) -> None:
    dump(step, model)
    if KILL_AT and step == KILL_AT and RANK == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def traced(task, *args, **kwargs):
    dump(0, task.model)
    return loop.train_loop(task, *args, **{**kwargs, "on_step": on_step})


dflash_train.train_loop = traced
eagle3_train.train_loop = traced
sys.exit(main(sys.argv[1:]))
