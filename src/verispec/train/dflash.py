"""Train a DFlash or DSpark drafter on cached target features (the shards of `verispec train data`).

Anchors: per sequence, random positions a in the response (a >= prompt_len). Block a is [x_a, mask x (B-1)] at
positions a .. a+B-1; it sees the context features strictly before a and itself (bidirectionally), exactly as at
inference, where the anchor is the last committed token and features exist for the positions before it. All
anchors of a step (several sequences packed) run in one forward with a mask. Block position k predicts x_{a+k}.
  DFlash loss: CE weighted exp(-(k-1)/gamma), gamma 7 for B=16, 4 for B=8, B/2 otherwise (normalised by the
               weights of the valid positions).
  DSpark loss: 0.1 CE + 0.9 sum_k exp(-k/4) ||p_d - p_t||_1 (summed over k, averaged over anchors)
               + 1.0 BCE(c_k, 1 - 0.5 ||p_d - p_t||_1); p_d = softmax(U_k + B_k) with the Markov head read from
               the data token x_{a+k-1} (teacher forcing); p_t = the target's distribution of x_{a+k}.
DSpark is then calibrated on the held-out anchors (train/calibrate.py); the temperatures go into the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from verispec.drafters.dflash_model import DFlashConfig, DFlashModel, TargetParts
from verispec.drafters.dspark_head import bce_confidence, soft_survival_label
from verispec.train.calibrate import fit_position_temperatures, per_position_ece
from verispec.train.distributed import Dist
from verispec.train.loop import LoopConfig, train_loop
from verispec.train.loop import add_args as loop_args
from verispec.train import share
from verispec.train.share import rank_data
from verispec.train.shards import TrainSequence, read_meta, target_logits


def gamma_for(block_size: int) -> float:
    return {16: 7.0, 8: 4.0}.get(block_size, block_size / 2)


@dataclass(frozen=True)
class TrainConfig:
    steps: int | None = None  # stop after this many steps ...
    max_minutes: float | None = None  # ... or this much wall time, whichever comes first
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup: int = 20  # steps
    grad_clip: float = 1.0
    anchors_per_seq: int = 32
    seqs_per_step: int = 4  # per rank and micro-batch
    accum: int = 1  # micro-batches per rank per step
    eval_every: int = 50
    save_every: int = 100  # steps between checkpoints (when training writes to a directory)
    heldout_frac: float = 0.1
    seed: int = 0
    amp: str = "off"  # bf16 autocast: "bf16", "off" or "auto" (`train.loop.amp_choice`)

    def loop(self) -> LoopConfig:
        return LoopConfig(steps=self.steps, max_minutes=self.max_minutes, lr=self.lr, warmup=self.warmup,
                          weight_decay=self.weight_decay, grad_clip=self.grad_clip, accum=self.accum,
                          eval_every=self.eval_every, save_every=self.save_every, seed=self.seed, amp=self.amp)

    def __post_init__(self) -> None:
        self.loop()  # validates the budget


@dataclass
class Batch:
    feats: torch.Tensor  # [C, len(layers) d] float32 feature rows of the packed sequences
    ctx_pos: torch.Tensor  # [C] position of each row in its sequence
    ctx_seq: torch.Tensor  # [C] sequence index of each row
    last_hidden: torch.Tensor  # [C, d] the target's post-norm states (its logits: last_hidden @ W_out^T)
    anchors: torch.Tensor  # [A] anchor token ids
    anchor_pos: torch.Tensor  # [A]
    anchor_seq: torch.Tensor  # [A]
    labels: torch.Tensor  # [A, B-1] x_{a+k} (0 where invalid)
    prev: torch.Tensor  # [A, B-1] x_{a+k-1}, the Markov head's teacher-forced input
    valid: torch.Tensor  # [A, B-1] a + k < T
    target_rows: torch.Tensor  # [A, B-1] packed row a+k-1 whose target logits predict x_{a+k}


def anchor_range(seq: TrainSequence) -> range:
    """Anchors inside the response with at least one label after them (and at least one context position)."""
    return range(max(seq.prompt_len, 1), len(seq.ids) - 1)


def has_anchors(length: int, prompt_len: int) -> bool:
    """Whether a sequence of `length` tokens with this prompt has any anchor (`anchor_range` not empty)."""
    return length - 1 > max(prompt_len, 1)


def pick_anchors(seq: TrainSequence, n: int, gen: torch.Generator) -> list[int]:
    r = anchor_range(seq)
    if len(r) <= n:
        return list(r)
    return sorted((torch.randperm(len(r), generator=gen)[:n] + r.start).tolist())


def make_batch(seqs: Sequence[TrainSequence], anchors: Sequence[Sequence[int]], layers: Sequence[int],
               block_size: int, device: torch.device) -> Batch:
    B = block_size
    k = torch.arange(1, B)  # [B-1]
    feats, pos, sid, last, a_ids, a_pos, a_seq, labels, prev, valid, rows = ([] for _ in range(11))
    off = 0
    for s, (seq, anc) in enumerate(zip(seqs, anchors)):
        T = len(seq.ids)
        feats.append(seq.features(layers).float())
        last.append(seq.last_hidden.float())
        pos.append(torch.arange(T))
        sid.append(torch.full((T,), s))
        a = torch.tensor(list(anc), dtype=torch.long)  # [A_s]
        tgt = a.unsqueeze(1) + k  # [A_s, B-1] positions a+k
        ok = tgt < T
        a_ids.append(seq.ids[a])
        a_pos.append(a)
        a_seq.append(torch.full((len(a),), s))
        labels.append(torch.where(ok, seq.ids[tgt.clamp(max=T - 1)], 0))
        prev.append(torch.where(ok, seq.ids[(tgt - 1).clamp(max=T - 1)], 0))
        valid.append(ok)
        rows.append(off + (tgt - 1).clamp(max=T - 1))
        off += T
    cat = lambda xs: torch.cat(xs).to(device)  # noqa: E731
    return Batch(cat(feats), cat(pos), cat(sid), cat(last), cat(a_ids), cat(a_pos), cat(a_seq), cat(labels),
                 cat(prev), cat(valid), cat(rows))


def compute_loss(model: DFlashModel, b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """The method's training loss and metrics: acc (top-1 vs the data), tau (teacher-forced greedy run length)."""
    cfg = model.cfg
    A, B = b.anchors.shape[0], cfg.block_size
    h = model.forward_train(b.feats, b.ctx_pos, b.ctx_seq, b.anchors, b.anchor_pos, b.anchor_seq)  # [A, B, d]
    hk = h[:, 1:][b.valid]  # [Nv, d] the predicting positions
    z = model.logits(hk)  # [Nv, V] float32
    y = b.labels[b.valid]  # [Nv]
    kk = torch.arange(1, B, device=z.device).expand(A, B - 1)[b.valid].float()  # [Nv] position k (1-based)
    stats: dict[str, float] = {}
    if model.markov is None:
        w = torch.exp(-(kk - 1) / gamma_for(B))
        loss = (w * F.cross_entropy(z, y, reduction="none")).sum() / w.sum()
    else:
        prev = b.prev[b.valid]
        z = z + model.markov.bias(prev).float()
        logp = z.log_softmax(-1)
        p_d = logp.exp()
        p_t = target_logits(b.last_hidden[b.target_rows[b.valid]], model.parts.out_weight.float()).softmax(-1)
        l1 = (p_d - p_t).abs().sum(-1)  # [Nv]
        ce = F.nll_loss(logp, y)
        l1_term = (torch.exp(-kk / 4) * l1).sum() / A
        conf = model.markov.conf_logits(hk, prev)
        bce = bce_confidence(conf, soft_survival_label(p_d.detach(), p_t)).mean()
        loss = 0.1 * ce + 0.9 * l1_term + bce
        stats.update(ce=float(ce.detach()), l1=float(l1.detach().mean()), bce=float(bce.detach()))
    correct = torch.zeros_like(b.valid)
    correct[b.valid] = z.argmax(-1) == y
    stats.update(loss=float(loss.detach()), acc=float(correct[:, 0][b.valid[:, 0]].float().mean()),
                 tau=float(correct.long().cumprod(1).sum(1).float().mean()))
    return loss, stats


def split(seqs: list[TrainSequence], frac: float, seed: int) -> tuple[list[TrainSequence], list[TrainSequence]]:
    """The sequences with anchors, split as `verispec train dflash` splits the catalog (train/share.py)."""
    return share.split([s for s in seqs if has_anchors(len(s.ids), s.prompt_len)], frac, seed)


def fixed_batches(model: DFlashModel, seqs: list[TrainSequence], tc: TrainConfig, device) -> list[Batch]:
    gen = torch.Generator().manual_seed(tc.seed + 12345)
    out = []
    for i in range(0, len(seqs), tc.seqs_per_step):
        part = seqs[i : i + tc.seqs_per_step]
        anchors = [pick_anchors(s, tc.anchors_per_seq, gen) for s in part]
        out.append(make_batch(part, anchors, model.cfg.feature_layers, model.cfg.block_size, device))
    return out


STATS = {False: ("acc", "loss", "tau"), True: ("acc", "bce", "ce", "l1", "loss", "tau")}


class BlockTask:
    """The loop's view of DFlash / DSpark training: micro-batches of random anchors from this rank's sequences,
    held-out metrics averaged over fixed held-out batches (summed over ranks)."""

    def __init__(self, model: DFlashModel, train: list[TrainSequence], held: list[TrainSequence],
                 tc: TrainConfig) -> None:
        if not train:
            raise ValueError("no training sequences on this rank")
        self.model, self.tc, self.train = model, tc, train
        self.name = "dspark" if model.cfg.dspark else "dflash"
        self.device = model.fc.weight.device
        self.held_batches = fixed_batches(model, held, tc, self.device)

    def sample(self, gen: torch.Generator) -> Batch:
        idx = torch.randint(len(self.train), (self.tc.seqs_per_step,), generator=gen).tolist()
        part = [self.train[i] for i in idx]
        anchors = [pick_anchors(s, self.tc.anchors_per_seq, gen) for s in part]
        return make_batch(part, anchors, self.model.cfg.feature_layers, self.model.cfg.block_size, self.device)

    def loss(self, b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        loss, stats = compute_loss(self.model, b)
        return loss, {**stats, "tokens": float(b.valid.sum())}

    def eval_sums(self) -> dict[str, float]:
        sums = dict.fromkeys(STATS[self.model.cfg.dspark], 0.0)
        for b in self.held_batches:
            for k, v in compute_loss(self.model, b)[1].items():
                sums[k] += v
        return {**sums, "batches": float(len(self.held_batches))}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(1.0, sums["batches"])
        return {k: v / n for k, v in sums.items() if k != "batches"}


def train_model(model: DFlashModel, seqs: list[TrainSequence], tc: TrainConfig, progress: bool = True) -> dict:
    """Train in place in this process on sequences already in memory; returns the loop's log."""
    train, held = split(seqs, tc.heldout_frac, tc.seed)
    log = train_loop(BlockTask(model, train, held, tc), tc.loop(), Dist.single(model.fc.weight.device),
                     progress=progress)
    return {"train_sequences": len(train), "heldout_sequences": len(held), **log}


@torch.no_grad()
def calibration_data(model: DFlashModel, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy left-to-right drafts of every held-out anchor, as at inference. Returns raw confidence logits,
    survival (draft tokens 1..k all equal the target's argmax; the target's argmax after the anchor is read along
    the data path) and valid, each [N, B-1]."""
    assert model.markov is not None, "calibration needs a DSpark model"
    out_w = model.parts.out_weight.float()
    L, S, V = [], [], []
    for b in batches:
        h = model.forward_train(b.feats, b.ctx_pos, b.ctx_seq, b.anchors, b.anchor_pos, b.anchor_seq)  # [A, B, d]
        U = model.logits(h[:, 1:])  # [A, B-1, V]
        toks, _, conf = model.markov.decode(U, h[:, 1:], b.anchors, lambda z, _k: z.argmax(-1))
        t_arg = target_logits(b.last_hidden[b.target_rows.flatten()], out_w).argmax(-1).view_as(toks)
        S.append(((toks == t_arg) & b.valid).long().cumprod(1).float())
        L.append(conf.float())
        V.append(b.valid)
    return torch.cat(L).cpu(), torch.cat(S).cpu(), torch.cat(V).cpu()


def calibrate(model: DFlashModel, batches: list[Batch], dist: Dist | None = None) -> dict:
    """Fit T_1..T_{B-1} on half of the held-out anchors (even rows), store them in the model's config, and score
    ECE per position before / after on the other half (odd rows), which the fit never saw. Under torchrun every
    rank contributes its held-out share and every rank fits the same temperatures."""
    parts = (dist or Dist.single("cpu")).gather(calibration_data(model, batches))
    logits, survival, valid = (torch.cat([p[i] for p in parts]) for i in range(3))
    fit, score = slice(0, None, 2), slice(1, None, 2)
    ones = torch.ones(logits.shape[1])
    before = per_position_ece(logits[score], survival[score], valid[score], ones)
    temps = fit_position_temperatures(logits[fit], survival[fit], valid[fit])
    model.with_temperatures(temps)
    after = per_position_ece(logits[score], survival[score], valid[score], torch.tensor(temps))
    return {"temperatures": temps, "ece_before": before, "ece_after": after,
            "mean_ece_before": sum(before) / len(before), "mean_ece_after": sum(after) / len(after),
            "anchors_fit": int(logits[fit].shape[0]), "anchors_scored": int(logits[score].shape[0])}


# ---- CLI --------------------------------------------------------------------------------------------------
def add_args(parser, method: str) -> None:
    parser.add_argument("--data", required=True, help="training data directory (from `verispec train data`)")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--model", default=None, help="the target model (default: the one named in the data)")
    parser.add_argument("--dtype", default="float32", help="dtype the target is loaded in; bfloat16 also trains "
                        "with bf16 autocast (float32 master weights), whatever --amp says")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--layers", type=int, default=None, help="draft decoder layers (default 3; --quick: 1)")
    parser.add_argument("--block-size", type=int, default=8, help="block size B (anchor + B-1 drafts)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 2000; --quick: 30)")
    parser.add_argument("--max-minutes", type=float, default=None, help="wall-time budget; stops at whichever "
                        "of --steps / --max-minutes comes first")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--anchors", type=int, default=32, help="random anchors per sequence per step")
    parser.add_argument("--batch-seqs", type=int, default=4, help="sequences per micro-batch (per rank)")
    parser.add_argument("--quick", action="store_true", help="tiny run for CI: 1 layer, 30 steps")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per rank and step (gradient "
                        "accumulation)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", default=None, help="start from this trained drafter (a directory or shipped "
                        "name) instead of fresh weights; its layers, block size and target layers are kept (a DFlash "
                        "path selector is dropped: it was fitted to the old backbone); `train dspark` also takes a "
                        "DFlash drafter: its backbone, with DSpark's heads fresh")
    loop_args(parser)
    if method == "dspark":
        parser.add_argument("--markov-rank", type=int, default=256, help="rank r of the Markov head W2 W1")


def initial_drafter(init: str, target, asked: DFlashConfig, layers_given: bool) -> DFlashModel:
    """`--init`: the trained drafter to go on training (float32, without a path selector), refused where it is
    another method or another shape than the run asks for (block size, Markov rank, --layers when given)."""
    from verispec.drafters.dflash import load
    from verispec.drafters.shipped import resolve

    model = load(resolve(init), target, inference=False).float().train()
    if asked.dspark and not model.cfg.dspark:
        model = with_markov_head(model, asked.markov_rank)
    c = model.cfg
    checks = [("dspark", c.dspark, asked.dspark), ("block_size", c.block_size, asked.block_size)]
    checks += [("markov_rank", c.markov_rank, asked.markov_rank)] if c.dspark and asked.dspark else []
    checks += [("num_layers", c.num_layers, asked.num_layers)] if layers_given else []
    bad = [f"{name} {have} (this run asks for {want})" for name, have, want in checks if have != want]
    if bad:
        raise ValueError(f"--init {init}: the drafter has {', '.join(bad)}; train {'dspark' if c.dspark else 'dflash'}"
                         " with its shape, or start afresh")
    model.selector = None
    return model


def with_markov_head(dflash: DFlashModel, rank: int) -> DFlashModel:
    """A DSpark drafter on a trained DFlash backbone: every backbone weight copied, DSpark's heads fresh (W2 = 0, so
    its drafts start as the DFlash drafter's; the confidence head untrained)."""
    from dataclasses import replace

    model = DFlashModel(replace(dflash.cfg, dspark=True, markov_rank=rank), dflash.parts)
    missing, unexpected = model.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("markov.") for k in missing), (missing, unexpected)
    return model.train()


def run(args, method: str) -> dict:
    """`verispec train dflash|dspark`: load this rank's data and the target, train (resuming from --out's newest
    checkpoint), calibrate (DSpark), and write the drafter from rank 0."""
    from verispec.models.loader import load_model, parse_dtype

    if method not in ("dflash", "dspark"):
        raise ValueError(f"unknown method {method!r}; expected dflash or dspark")
    dist = Dist.from_env(args.device)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    meta = read_meta(args.data)
    target, _ = load_model(args.model or meta["model"], dtype=args.dtype, device=dist.device)
    t = target.cfg
    if (meta.get("hidden_size"), meta.get("num_layers")) != (t.hidden_size, t.num_layers):
        raise ValueError(f"{args.data} was captured from a target with hidden size {meta.get('hidden_size')} and "
                         f"{meta.get('num_layers')} layers; --model has {t.hidden_size} and {t.num_layers}")
    layers = args.layers or (1 if args.quick else 3)
    extra = {"markov_rank": args.markov_rank} if method == "dspark" else {}
    cfg = DFlashConfig.for_target(t, num_layers=layers, block_size=args.block_size, dspark=method == "dspark", **extra)
    init = None if args.init is None else initial_drafter(args.init, target, cfg, args.layers is not None)
    cfg = cfg if init is None else init.cfg
    missing = sorted(set(cfg.feature_layers) - set(meta.get("layers", [])))
    if missing:
        raise ValueError(f"{args.data} has no hidden states for layers {missing} (needed: {list(cfg.feature_layers)}); "
                         f"regenerate it with `verispec train data --layers` including them")
    model = DFlashModel(cfg, TargetParts.of(target, dtype=torch.float32)) if init is None else init
    model = model.to(dist.device)
    del target
    steps = args.steps or (30 if args.quick else (None if args.max_minutes else 2000))
    tc = TrainConfig(steps=steps, max_minutes=args.max_minutes, lr=args.lr, anchors_per_seq=args.anchors,
                     seqs_per_step=args.batch_seqs, accum=args.accum, seed=args.seed,
                     eval_every=10 if args.quick else 50, save_every=args.save_every,
                     amp="bf16" if parse_dtype(args.dtype) == torch.bfloat16 else args.amp,
                     **({} if args.holdout is None else {"heldout_frac": args.holdout}))
    data = rank_data(args.data, dist, cfg.feature_layers, tc.heldout_frac, tc.seed,
                     usable=lambda r: has_anchors(r.length, r.prompt_len))
    task = BlockTask(model, data.train, data.held, tc)
    fingerprint = {"method": method, "data": str(Path(args.data).resolve()), "sequences": meta.get("num_sequences"),
                   "drafter": repr(cfg), "init": args.init, "holdout": tc.heldout_frac}
    log = train_loop(task, tc.loop(), dist, args.out, fingerprint, resume=not args.no_resume)
    log.update(train_sequences=data.train_total, heldout_sequences=data.held_total)
    if cfg.dspark:
        log["calibration"] = calibrate(model, task.held_batches, dist)
    if dist.is_writer:
        model.save_pretrained(args.out)
        log.update(method=method, data=str(args.data), target=args.model or meta["model"], block_size=cfg.block_size,
                   num_layers=cfg.num_layers, target_layer_ids=list(cfg.target_layer_ids))
        Path(args.out, "train_log.json").write_text(json.dumps(log, indent=1))
    dist.barrier()
    dist.close()
    return log
