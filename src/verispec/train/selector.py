"""Train DFlash 2's path selector (drafters/path_selector.py) on top of a trained, frozen DFlash drafter.

The drafter runs once over the self-distillation data (every anchor of every response, batched): per anchor the
top-m candidates of each block position with DFlash's log-probabilities, the block's hidden states, the data's
next tokens. The selector then trains on those cached rows alone: cross-entropy over the m candidates at every
position whose data token is among them, teacher-forced on the data's previous token, weighted exp(-(k-1)/gamma)
as DFlash's own loss. Held-out metrics compare the selector's greedy walk with DFlash's per-position argmax on the
same anchors: first-position accuracy and the accepted run length (tokens matching the data before the first miss).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from verispec.drafters.dflash_model import DFlashModel
from verispec.drafters.path_selector import PathSelector, SelectorConfig
from verispec.train.dflash import TrainConfig, gamma_for, make_batch, pick_anchors, split
from verispec.train.distributed import Dist
from verispec.train.loop import train_loop
from verispec.train.shards import TrainSequence

T = TypeVar("T")


@dataclass
class Rows:
    """Cached drafter outputs, one row per anchor: vals, cand [N, g, m]; h [N, g, d]; y, valid [N, g]; anchor [N]."""

    vals: torch.Tensor
    cand: torch.Tensor
    h: torch.Tensor
    y: torch.Tensor
    valid: torch.Tensor
    anchor: torch.Tensor

    def take(self, idx: torch.Tensor) -> "Rows":
        return Rows(*(t[idx] for t in (self.vals, self.cand, self.h, self.y, self.valid, self.anchor)))

    def __len__(self) -> int:
        return self.anchor.shape[0]


@torch.no_grad()
def collect(model: DFlashModel, seqs: list[TrainSequence], top_m: int, anchors_per_seq: int = 64,
            seqs_per_batch: int = 4, seed: int = 0, progress: bool = False) -> Rows:
    """Run the frozen drafter over `seqs` (up to anchors_per_seq random anchors each) and cache what the selector
    reads."""
    from tqdm.auto import tqdm

    gen = torch.Generator().manual_seed(seed)
    device, B = model.fc.weight.device, model.cfg.block_size
    parts: list[tuple[torch.Tensor, ...]] = []
    for i in tqdm(range(0, len(seqs), seqs_per_batch), disable=not progress, desc="selector rows"):
        chunk = seqs[i : i + seqs_per_batch]
        b = make_batch(chunk, [pick_anchors(s, anchors_per_seq, gen) for s in chunk], model.cfg.feature_layers, B,
                       device)
        h = model.forward_train(b.feats, b.ctx_pos, b.ctx_seq, b.anchors, b.anchor_pos, b.anchor_seq)[:, 1:]
        vals, cand = torch.log_softmax(model.logits(h), -1).topk(top_m, dim=-1)  # [A, g, m]
        parts.append((vals.cpu(), cand.cpu(), h.float().cpu(), b.labels.cpu(), b.valid.cpu(), b.anchors.cpu()))
    return Rows(*(torch.cat([p[j] for p in parts]) for j in range(6)))


def step_logits(sel: PathSelector, rows: Rows, embed: torch.Tensor) -> torch.Tensor:
    """[N, g, m] teacher-forced step logits: the previous token is the data's (the anchor at position 1)."""
    unary, right = sel.scores(rows.vals, rows.cand, rows.h, embed)
    prev = torch.cat([rows.anchor[:, None], rows.y[:, :-1]], dim=1)  # [N, g]
    return sel.step_logits(unary, right, prev, embed)


def loss_of(sel: PathSelector, rows: Rows, embed: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    z = step_logits(sel, rows, embed).float()  # [N, g, m]
    hit = rows.cand == rows.y[..., None]  # [N, g, m] where the data token sits among the candidates
    present = hit.any(-1) & rows.valid  # [N, g]
    g = z.shape[1]
    w = torch.exp(-torch.arange(g, dtype=torch.float32) / gamma_for(g + 1)) * present  # [N, g]
    nll = -(z.log_softmax(-1) * hit).sum(-1)  # [N, g]
    loss = (w * nll).sum() / w.sum().clamp(min=1.0)
    return loss, {"loss": float(loss.detach()), "present": float(present.float().mean())}


@torch.no_grad()
def greedy_walk(sel: PathSelector, rows: Rows, embed: torch.Tensor) -> torch.Tensor:
    """[N, g] the selector's greedy tokens, all anchors at once (the drafter's walk, vectorised)."""
    unary, right = sel.scores(rows.vals, rows.cand, rows.h, embed)
    prev = rows.anchor
    out = []
    for k in range(unary.shape[1]):
        z = sel.step_logits(unary[:, k : k + 1], right[:, k : k + 1], prev[:, None], embed)[:, 0]  # [N, m]
        prev = rows.cand[:, k].gather(1, z.argmax(-1, keepdim=True)).squeeze(1)
        out.append(prev)
    return torch.stack(out, 1)


def run_lengths(tokens: torch.Tensor, rows: Rows) -> torch.Tensor:
    """[N] how many leading drafted tokens equal the data's."""
    return ((tokens == rows.y) & rows.valid).long().cumprod(1).sum(1)


class SelectorTask:
    """The training loop's view: micro-batches of cached rows; held-out sums of nll, first-position accuracy and
    run length for the selector and for DFlash's argmax on the same anchors."""

    name = "selector"

    def __init__(self, sel: PathSelector, train: Rows, held: Rows, embed: torch.Tensor, batch: int) -> None:
        self.model, self.train, self.held, self.embed, self.batch = sel, train, held, embed, batch

    def sample(self, gen: torch.Generator) -> Rows:
        return self.train.take(torch.randint(len(self.train), (self.batch,), generator=gen))

    def loss(self, rows: Rows) -> tuple[torch.Tensor, dict[str, float]]:
        loss, stats = loss_of(self.model, rows, self.embed)
        return loss, {**stats, "tokens": float(rows.valid.sum())}

    @torch.no_grad()
    def eval_sums(self) -> dict[str, float]:
        was = self.model.training
        self.model.eval()
        walk = greedy_walk(self.model, self.held, self.embed)
        base = self.held.cand[..., 0]  # DFlash's own argmax per position
        ok = self.held.valid[:, 0]
        self.model.train(was)
        return {"anchors": float(len(self.held)), "acc": float(((walk[:, 0] == self.held.y[:, 0]) & ok).sum()),
                "base_acc": float(((base[:, 0] == self.held.y[:, 0]) & ok).sum()),
                "run": float(run_lengths(walk, self.held).sum()), "base_run": float(run_lengths(base, self.held).sum())}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(1.0, sums["anchors"])
        return {k: v / n for k, v in sums.items() if k != "anchors"}


def train_selector(model: DFlashModel, seqs: list[TrainSequence], tc: TrainConfig, top_m: int = 8, rank: int = 64,
                   batch: int = 256, anchors_per_seq: int = 64, progress: bool = True) -> tuple[PathSelector, dict]:
    """A selector for the DFlash `model` (frozen: it only runs under no_grad), trained on cached rows of `seqs`."""
    if model.cfg.dspark:
        raise ValueError("the path selector replaces DSpark's serial head: train it on a DFlash drafter")
    train_seqs, held_seqs = split(seqs, tc.heldout_frac, tc.seed)
    t0 = time.perf_counter()
    train = collect(model, train_seqs, top_m, anchors_per_seq, tc.seqs_per_step, tc.seed, progress)
    held = collect(model, held_seqs, top_m, anchors_per_seq, tc.seqs_per_step, tc.seed + 1, progress)
    collect_s = time.perf_counter() - t0
    torch.manual_seed(tc.seed)
    sel = PathSelector(SelectorConfig(model.cfg.hidden_size, model.cfg.vocab_size, model.cfg.block_size - 1,
                                      top_m, rank))
    embed = model.parts.embed.float()
    log = train_loop(SelectorTask(sel, train, held, embed, batch), tc.loop(), Dist.single("cpu"), progress=progress)
    sel.eval().requires_grad_(False)
    return sel, {"selector_params": sel.num_params(), "train_anchors": len(train), "heldout_anchors": len(held),
                 "collect_s": round(collect_s, 1), **log}


# ---- CLI --------------------------------------------------------------------------------------------------
def add_args(parser) -> None:
    parser.add_argument("--drafter", required=True, help="the trained DFlash checkpoint (directory or shipped name)")
    parser.add_argument("--data", required=True, help="self-distillation data (from `verispec train data`)")
    parser.add_argument("--out", required=True, help="where to write the DFlash checkpoint with its selector")
    parser.add_argument("--model", default=None, help="the target model (default: the one named in the data)")
    parser.add_argument("--top-m", type=int, default=8, help="candidates kept per block position")
    parser.add_argument("--rank", type=int, default=64, help="rank of the selector's bilinear terms")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=256, help="anchors per step")
    parser.add_argument("--anchors-per-seq", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-sequences", type=_count, default=None,
                        help="train on a random subset of this many sequences (seeded); running the drafter over "
                             "every sequence of a large data set first takes hours on a CPU")


def _count(text: str) -> int:
    """--max-sequences: a whole number of at least 2 (one each for training and the held-out share)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-sequences must be a whole number, got {text!r}") from None
    if n < 2:
        raise argparse.ArgumentTypeError(f"--max-sequences must be at least 2, got {n}")
    return n


def subset(seqs: list[T], n: int | None, seed: int = 0) -> list[T]:
    """n of `seqs` (sequences or their refs) drawn without replacement (seeded), in their data order; all of them
    when n is None or larger."""
    if n is None or n >= len(seqs):
        return seqs
    keep = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return [seqs[int(i)] for i in keep]


def run(args) -> dict:
    from verispec.drafters.dflash import load
    from verispec.drafters.shipped import resolve
    from verispec.models.loader import load_model
    from verispec.train.share import catalog
    from verispec.train.share import load as load_refs
    from verispec.train.shards import read_meta

    data = Path(args.data)
    target, _ = load_model(args.model or read_meta(data)["model"], dtype=args.dtype, progress=False)
    src = resolve(args.drafter)
    model = load(src, target, inference=False)
    # only the chosen sequences and the drafter's layers are read (the whole 1M-token set in float32 would not fit)
    seqs = load_refs(data, subset(catalog(data), args.max_sequences), model.cfg.feature_layers)
    tc = TrainConfig(steps=args.steps, max_minutes=args.max_minutes, lr=args.lr, warmup=20, eval_every=100,
                     save_every=0, seqs_per_step=4)
    sel, log = train_selector(model, seqs, tc, args.top_m, args.rank, args.batch, args.anchors_per_seq)
    log["sequences"] = len(seqs)
    out = Path(args.out)
    if out.resolve() != Path(src).resolve():
        shutil.copytree(src, out, dirs_exist_ok=True)
    sel.save(out, {"trained_on": str(data), "drafter": str(args.drafter), "heldout": log["heldout"][-1]})
    (out / "selector_log.json").write_text(json.dumps(log, indent=1, default=str))
    return log
