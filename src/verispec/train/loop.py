"""The one training loop every drafter uses: one process or many ranks under `torchrun` (DistributedDataParallel),
gradient accumulation, warm-up + cosine learning rate, a step and/or wall-time budget that every rank reads the same
way, held-out evaluation summed over ranks, and checkpoints to resume from.

A method supplies a `Task`: how to draw one micro-batch from this rank's data, its loss, and held-out sums. One
optimizer step sees world * accum micro-batches; each rank's gradient is the mean over its own accum, DDP averages
over ranks, so the step equals one process accumulating the same world * accum micro-batches.
"""

from __future__ import annotations

import argparse
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn

from verispec.train import checkpoint
from verispec.train.distributed import Dist


AMP_CHOICES = ("auto", "bf16", "off")


def amp_choice(amp: str, device: torch.device) -> str:
    """"bf16" or "off": what `amp` means on `device`. "auto" is bf16 autocast where the device computes in bf16
    natively (a CUDA GPU that supports it; a CPU with AVX-512 BF16 or AMX, where oneDNN runs bf16 matmuls: on a
    2-core Zen 4, EAGLE-3 trained x1.7 faster so, README) and float32 elsewhere (an AVX2 CPU has no bf16 arithmetic
    and would only convert back and forth). Master weights and the optimizer stay float32 either way."""
    if amp != "auto":
        return amp
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "off"
    if device.type == "cpu":
        from verispec.kernels.cpu import cpu_info

        return "bf16" if {"avx512_bf16", "amx_bf16"} & set(cpu_info().flags) else "off"
    return "off"


@dataclass(frozen=True)
class LoopConfig:
    steps: int | None = None  # stop after this many optimizer steps ...
    max_minutes: float | None = None  # ... or this much training time (summed over resumed sessions), first wins
    lr: float = 6e-4
    warmup: int = 20  # steps of linear warm-up
    final_lr: float = 0.0  # the cosine ends at this fraction of lr
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    accum: int = 1  # micro-batches per rank per step
    eval_every: int = 50  # steps between held-out evaluations (plus one at the start and one at the end)
    save_every: int = 100  # steps between checkpoints (plus one at the end); 0: only at the end
    seed: int = 0
    amp: str = "off"  # bf16 autocast: "bf16", "off", or "auto" (where the device has bf16 arithmetic: `amp_choice`)

    def __post_init__(self) -> None:
        if self.amp not in AMP_CHOICES:
            raise ValueError(f"amp must be one of {AMP_CHOICES}, got {self.amp!r}")
        if self.steps is None and self.max_minutes is None:
            raise ValueError("give a number of steps and/or a time budget (max_minutes)")
        if (self.steps is not None and self.steps < 1) or (self.max_minutes is not None and self.max_minutes <= 0):
            raise ValueError("steps and max_minutes must be positive")
        if self.accum < 1 or self.eval_every < 1 or self.save_every < 0:
            raise ValueError("accum and eval_every must be >= 1, save_every >= 0")


class Task(Protocol):
    model: nn.Module
    name: str

    def sample(self, gen: torch.Generator) -> Any:
        """One micro-batch of this rank's training data, drawn with `gen` (the only randomness)."""

    def loss(self, micro: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """The differentiable loss of a micro-batch and its stats; stats["tokens"] counts trained positions."""

    def eval_sums(self) -> dict[str, float]:
        """Sums over this rank's held-out data (the same keys on every rank, also when it holds none)."""

    def metrics(self, sums: dict[str, float]) -> dict[str, Any]:
        """Held-out metrics from the sums over all ranks."""


class _Loss(nn.Module):
    """Wraps the task so that DDP sees one forward per micro-batch (its gradient hooks sit on the task's model)."""

    def __init__(self, task: Task) -> None:
        super().__init__()
        self.model = task.model
        self._task = [task]

    def forward(self, micro: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return self._task[0].loss(micro)


def lr_factor(step: int, progress: float, warmup: int, final: float = 0.0) -> float:
    """Linear warm-up over `warmup` steps, then cosine from 1 down to `final` over progress in [0, 1]."""
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return min(1.0, (step + 1) / max(1, warmup)) * (final + (1 - final) * cos)


def evaluate(task: Task, dist: Dist, amp) -> dict[str, Any]:
    was = task.model.training
    task.model.eval()
    with torch.no_grad(), amp():
        sums = task.eval_sums()
    task.model.train(was)
    keys = sorted(sums)
    return task.metrics(dict(zip(keys, dist.sum([sums[k] for k in keys]))))


@dataclass
class _Run:
    """The mutable state of one training run (what a checkpoint stores, plus this session's clock)."""

    step: int
    spent: float  # training seconds of earlier sessions
    log: dict[str, Any]
    t0: float = 0.0

    def elapsed(self, dist: Dist) -> float:
        return self.spent + dist.max(time.monotonic() - self.t0)  # one clock for all ranks: they stop together


def _start(task: Task, opt: torch.optim.Optimizer, gen: torch.Generator, dist: Dist, out, fingerprint: dict,
           resume: bool, amp) -> _Run:
    """Resume from the newest checkpoint in out (same fingerprint and world size), or start at step 0."""
    found = checkpoint.latest(out) if out is not None and resume else None
    if found is None:
        log = {"world_size": dist.world, "loss": [], "train_tokens": 0, "train_step_s": 0.0,
               "heldout": [{"step": 0, **evaluate(task, dist, amp)}]}
        return _Run(0, 0.0, log, time.monotonic())
    state = checkpoint.load(found, fingerprint, dist.world)
    task.model.load_state_dict(state.model)
    opt.load_state_dict(state.optimizer)
    gen.set_state(state.generators[dist.rank])
    state.log.setdefault("resumed_at", []).append(state.step)
    return _Run(state.step, state.elapsed_s, state.log, time.monotonic())


def _save(out, run: _Run, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, dist: Dist,
          fingerprint: dict) -> None:
    """A checkpoint of the run so far: every rank hands in its generator, rank 0 writes (nothing without `out`)."""
    gens = dist.gather(gen.get_state())
    if out is not None and dist.is_writer:
        checkpoint.save(out, checkpoint.TrainState(run.step, run.spent + time.monotonic() - run.t0, model.state_dict(),
                                                   opt.state_dict(), gens, run.log, dist.world, fingerprint))
    dist.barrier()


def _step(net: nn.Module, task: Task, gen: torch.Generator, cfg: LoopConfig, dist: Dist, amp) -> tuple[float, float]:
    """Forward and backward of this rank's accum micro-batches (DDP all-reduces the gradients on the last one);
    returns (mean loss, trained tokens) of this rank."""
    loss_sum, tokens = 0.0, 0.0
    for m in range(cfg.accum):
        sync = net.no_sync() if dist.active and m < cfg.accum - 1 else nullcontext()  # type: ignore[operator]
        with sync:
            with amp():
                loss, stats = net(task.sample(gen))
            (loss / cfg.accum).backward()
        loss_sum += float(loss.detach()) / cfg.accum
        tokens += stats.get("tokens", 0.0)
    return loss_sum, tokens


def train_loop(task: Task, cfg: LoopConfig, dist: Dist, out: str | Path | None = None,
               fingerprint: dict | None = None, resume: bool = True, progress: bool = True,
               on_step: Callable[[int, nn.Module], None] | None = None) -> dict[str, Any]:
    """Train task.model in place (it must already sit on dist.device); returns the log. With `out`, checkpoints go to
    out/checkpoints and a run with the same fingerprint resumes from the newest one. on_step(step, model) runs
    after every optimizer step (logging, tests)."""
    from tqdm.auto import tqdm

    model = task.model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + dist.rank)  # each rank draws its own micro-batches
    precision = amp_choice(cfg.amp, dist.device)
    amp = (lambda: torch.autocast(dist.device.type, dtype=torch.bfloat16)) if precision == "bf16" else nullcontext
    fingerprint = {**(fingerprint or {}), "task": task.name, "config": repr(cfg)}
    run = _start(task, opt, gen, dist, out, fingerprint, resume, amp)
    run.log["amp"] = precision
    net = nn.parallel.DistributedDataParallel(_Loss(task), device_ids=[dist.device.index] if dist.device.type ==
                                              "cuda" else None) if dist.active else _Loss(task)
    budget = cfg.max_minutes * 60 if cfg.max_minutes is not None else None
    save = lambda: _save(out, run, model, opt, gen, dist, fingerprint)  # noqa: E731
    bar = tqdm(total=cfg.steps, initial=run.step, disable=not (progress and dist.is_writer), desc=f"train {task.name}")
    model.train()
    while True:
        prog = max(run.step / cfg.steps if cfg.steps else 0.0, run.elapsed(dist) / budget if budget else 0.0)
        if prog >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = cfg.lr * lr_factor(run.step, prog, cfg.warmup, cfg.final_lr)
        t = time.monotonic()
        opt.zero_grad(set_to_none=True)
        loss, tokens = _step(net, task, gen, cfg, dist, amp)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        run.step += 1
        loss_all, tokens_all, step_s = dist.sum([loss, tokens, time.monotonic() - t])
        run.log["loss"].append(round(loss_all / dist.world, 5))
        run.log["train_tokens"] += int(tokens_all)
        run.log["train_step_s"] += step_s / dist.world
        bar.update(1)
        bar.set_postfix(loss=f"{loss_all / dist.world:.3f}")
        if on_step is not None:
            on_step(run.step, model)
        if run.step % cfg.eval_every == 0:
            run.log["heldout"].append({"step": run.step, **evaluate(task, dist, amp)})
        if cfg.save_every and run.step % cfg.save_every == 0:
            save()
    bar.close()
    if run.log["heldout"][-1]["step"] != run.step:
        run.log["heldout"].append({"step": run.step, **evaluate(task, dist, amp)})
    step_s = max(run.log["train_step_s"], 1e-9)
    run.log.update(steps=run.step, wall_seconds=round(run.elapsed(dist), 2),
                   train_tokens_per_s=round(run.log["train_tokens"] / step_s, 1))
    save()
    model.eval()
    return run.log


def holdout_frac(text: str) -> float:
    """--holdout: a share strictly between 0 and 1."""
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--holdout must be a number, got {text!r}") from None
    if not 0.0 < f < 1.0:
        raise argparse.ArgumentTypeError(f"--holdout must be between 0 and 1 (exclusive), got {f}")
    return f


def add_args(p) -> None:
    """The loop's command-line options, shared by every `verispec train <method>`."""
    p.add_argument("--amp", default="auto", choices=AMP_CHOICES, help="bf16 autocast (float32 master weights): "
                   "auto = where the device computes bf16 natively (CUDA; a CPU with AVX-512 BF16 or AMX)")
    p.add_argument("--holdout", type=holdout_frac, default=None, help="share of the sequences held out for the "
                   "learning curve (default: eagle3 0.05, dflash / dspark 0.1); on a large data set a smaller share "
                   "keeps each evaluation short")
    p.add_argument("--save-every", type=int, default=100, help="steps between resumable checkpoints in "
                   "OUT/checkpoints (0: only at the end)")
    p.add_argument("--no-resume", action="store_true", help="start afresh even if OUT/checkpoints holds a "
                   "checkpoint of this run (by default the newest one is resumed)")
