"""`verispec train eagle3`: the EAGLE-3 head by self-distillation with the training-time-test (TTT) unroll.

For one sequence of T tokens (n = T - 1 query indices), unroll step i (0-based) asks, at every index j at once:
"with the context ending at x_{j+1} (features f_0..f_j), what is draft token i+1?" The query at index j, step i
  - reads the feature h^{i-1}_j (step 0: the target's fused feature f_j) and the token x_{j+1+i},
  - sits at position j + i,
  - attends to step-0 keys at indices <= j (the committed context) and to its own chain's keys of steps 1..i
    (index j of each earlier step): exactly what the drafter sees at inference, so training matches inference;
  - is trained against the target's distribution at position j + 1 + i (soft cross-entropy over the draft
    vocabulary), with weight 0.8^i.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.drafters.draft_vocab import most_frequent
from verispec.drafters.eagle3 import Eagle3Config, Eagle3Head
from verispec.drafters.eagle3 import load as load_head
from verispec.execution.features import eagle3_layers
from verispec.drafters.shipped import resolve as resolve_drafter
from verispec.models.llama import LlamaModel
from verispec.train.distributed import Dist
from verispec.train.label_cache import cached_labels
from verispec.train.loop import LoopConfig, train_loop
from verispec.train.loop import add_args as loop_args
from verispec.train.share import rank_data
from verispec.train.shards import TrainSequence, read_meta, target_logits

DECAY = 0.8


def token_counts(seqs: list[TrainSequence], vocab: int) -> torch.Tensor:
    """[vocab] how often each token occurs in the responses."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.ids[s.prompt_len :], minlength=vocab)[:vocab]
    return counts


def choose_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent tokens (ties: lower id; padded with the lowest unused ids).
    Returns d2t [size] (target id = draft id + d2t) and t2d [vocab] bool."""
    vocab = counts.shape[0]
    chosen = most_frequent(counts, size)
    d2t = chosen - torch.arange(size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def build_vocab(seqs: list[TrainSequence], size: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return choose_vocab(token_counts(seqs, vocab), size)


def _ttt_attend(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """q: [n, H, hd]; ks[0]/vs[0]: [n, K, hd] step-0 keys (causal); ks[k]/vs[k], k >= 1: the chain's own keys at the
    same index (diagonal). Returns [n, H hd]."""
    n, H, hd = q.shape
    G = H // ks[0].shape[1]
    rep = [k.repeat_interleave(G, dim=1) for k in ks]  # [n, H, hd] each
    vrep = [v.repeat_interleave(G, dim=1) for v in vs]
    scale = 1 / math.sqrt(hd)
    s0 = torch.einsum("nhd,mhd->hnm", q, rep[0]) * scale  # [H, n, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    s0 = s0.masked_fill(causal, float("-inf"))
    parts = [s0]
    if len(ks) > 1:
        diag = torch.stack([(q * k).sum(-1) for k in rep[1:]], dim=-1) * scale  # [n, H, i]
        parts.append(diag.permute(1, 0, 2))  # [H, n, i]
    p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)  # [H, n, n + i]
    out = torch.einsum("hnm,mhd->nhd", p[..., :n], vrep[0])
    if len(ks) > 1:
        out = out + torch.einsum("hni,nihd->nhd", p[..., n:], torch.stack(vrep[1:], dim=1))
    return out.reshape(n, H * hd)


def ttt_logits(head: Eagle3Head, feats: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """feats: [T, len(layers) d] target features, ids: [T] -> per unroll step the draft logits [n, Vd], n = T - 1.
    Step i, index j: the head's logits for draft token i + 1 after the context x_0..x_{j+1}."""
    T = ids.shape[0]
    n = T - 1
    f = head.fc(feats[:n])  # [n, d] f_0..f_{n-1}
    pad = torch.zeros(steps, dtype=ids.dtype, device=ids.device)
    toks = torch.cat([ids, pad])
    pos = torch.arange(n, device=ids.device)
    ks, vs, out = [], [], []
    h = f
    for i in range(steps):
        q, k, v = head.qkv(head.embed(toks[1 + i : 1 + i + n]), h, pos + i)
        ks.append(k)
        vs.append(v)
        h = head.post(h, _ttt_attend(q, ks, vs))
        out.append(head.logits(h))
    return out


TOPK = 32  # soft labels keep the target's 32 most likely tokens per position (>= 0.99 of the mass, typically)


@dataclass(frozen=True)
class SoftLabels:
    """The target's distribution at each position of one sequence, cut to its top TOPK tokens, computed once."""

    ids: torch.Tensor  # [T, TOPK] target token ids, most likely first
    probs: torch.Tensor  # [T, TOPK] their probabilities under the full-vocabulary softmax


def soft_labels(seq: TrainSequence, out_w: torch.Tensor, max_len: int) -> SoftLabels:
    """Only the rows the loss reads (from the last prompt position on) go through the vocabulary projection; the
    prompt's rows are zero-probability placeholders (the projection is most of the cost on a large data set)."""
    T = min(len(seq.ids), max_len)
    start = min(max(0, seq.prompt_len - 1), T)
    with torch.no_grad():
        h = seq.last_hidden[start:T].to(out_w.device)
        p = torch.softmax(target_logits(h, out_w).float(), dim=-1)  # [T - start, V]
        probs, ids = p.topk(TOPK, dim=-1)
        ids = torch.cat([ids.new_zeros(start, TOPK), ids])  # [T, TOPK]
        probs = torch.cat([probs.new_zeros(start, TOPK), probs])
    return SoftLabels(ids, probs)


def _pair(lab: SoftLabels) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, probs) as the label cache stores them (dataclasses.astuple would deep-copy the tensors)."""
    return lab.ids, lab.probs


def sequence_loss(head: Eagle3Head, seq: TrainSequence, lab: SoftLabels, steps: int, max_len: int
                  ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Weighted soft cross-entropy of one sequence; also (correct top-1, counted) per step for accuracy.
    The target distribution is its top-TOPK mass restricted to the draft vocabulary (mass elsewhere is dropped)."""
    w = head.fc.weight
    ids = seq.ids[:max_len].to(w.device)
    T = ids.shape[0]
    feats = seq.features(head.feature_layers)[:T].to(w)  # stored bf16, trained in the head's dtype
    with torch.no_grad():
        t2d_index = torch.cumsum(head.t2d.long(), 0) - 1  # [V] draft id of a target id (valid where t2d)
        in_draft = head.t2d[lab.ids]  # [T, TOPK]
        draft_of = torch.where(in_draft, t2d_index[lab.ids], 0)  # [T, TOPK]
        weight = lab.probs * in_draft  # [T, TOPK]
        top_t = lab.ids[:, 0]  # [T] the target's greedy token
    logits = ttt_logits(head, feats, ids, steps)
    n = T - 1
    j = torch.arange(n, device=w.device)
    total = torch.zeros((), device=w.device)
    acc = []
    for i, lg in enumerate(logits):
        r = j + 1 + i  # the target position whose distribution step i predicts
        valid = (r <= T - 2) & (r >= seq.prompt_len - 1)
        if not valid.any():
            acc.append((0, 0))
            continue
        rv = r[valid]
        logq = F.log_softmax(lg[valid], dim=-1)  # [nv, Vd]
        total = total + DECAY**i * -(weight[rv] * logq.gather(1, draft_of[rv])).sum(-1).mean()
        with torch.no_grad():
            pred = head.to_target_ids(lg[valid].argmax(-1))
            acc.append((int((pred == top_t[rv]).sum()), int(valid.sum())))
    return total, acc


def expected_tau(acc_per_step: list[float]) -> float:
    """1 + sum_i prod_{k<=i} a_k: the mean accepted length if step accuracies were independent (an estimate)."""
    tau, run = 1.0, 1.0
    for a in acc_per_step:
        run *= a
        tau += run
    return tau


class Eagle3Task:
    """The loop's view of EAGLE-3 training: a micro-batch is one sequence of this rank's share (the step
    accumulates --batch of them); held-out sums are the TTT loss and per-step top-1 counts."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head, train: list[TrainSequence], held: list[TrainSequence], out_w: torch.Tensor,
                 steps: int, max_len: int, progress: bool = False, cache_dir: str | Path | None = None) -> None:
        """cache_dir: the data directory, where the soft labels are kept for the next run (train/label_cache.py)."""
        self.model, self.train, self.held, self.steps, self.max_len = head, train, held, steps, max_len
        rows, self.labels_cached = cached_labels(held + train, out_w, TOPK, max_len, cache_dir,
                                                 lambda q: _pair(soft_labels(q, out_w, max_len)), progress)
        labels = [SoftLabels(ids, probs) for ids, probs in rows]
        self.held_labels, self.train_labels = labels[: len(held)], labels[len(held) :]

    def sample(self, gen: torch.Generator) -> int:
        return int(torch.randint(len(self.train), (1,), generator=gen))

    def loss(self, k: int) -> tuple[torch.Tensor, dict[str, float]]:
        loss, acc = sequence_loss(self.model, self.train[k], self.train_labels[k], self.steps, self.max_len)
        return loss, {"loss": float(loss.detach()), "tokens": float(acc[0][1])}

    def eval_sums(self) -> dict[str, float]:
        sums = {"loss": 0.0, "sequences": float(len(self.held))}
        sums.update({f"right{i}": 0.0 for i in range(self.steps)} | {f"count{i}": 0.0 for i in range(self.steps)})
        for s, lab in zip(self.held, self.held_labels):
            loss, acc = sequence_loss(self.model, s, lab, self.steps, self.max_len)
            sums["loss"] += float(loss)
            for i, (a, c) in enumerate(acc):
                sums[f"right{i}"] += a
                sums[f"count{i}"] += c
        return sums

    def metrics(self, sums: dict[str, float]) -> dict:
        accs = [sums[f"right{i}"] / sums[f"count{i}"] if sums[f"count{i}"] else 0.0 for i in range(self.steps)]
        return {"loss": sums["loss"] / max(1.0, sums["sequences"]), "top1_per_step": [round(a, 4) for a in accs],
                "conditional_tau_estimate": round(expected_tau(accs), 3)}


def make_head(target: LlamaModel, train: list[TrainSequence], dist: Dist, draft_vocab: int, steps: int,
              intermediate_size: int | None, init: str | None = None) -> Eagle3Head:
    """A fresh head (the same on every rank: the seed, and the vocabulary from response counts over all ranks),
    its output layer and final norm started from the target's; or, with `init`, a trained head to go on training
    on other data (its draft vocabulary kept, the rest of its shape must agree)."""
    layers = eagle3_layers(target.cfg.num_layers)
    if init is not None:
        head = load_head(init, target, inference=False).float().train().requires_grad_(True)
        want = {"feature_layers": tuple(layers), "draft_vocab_size": draft_vocab,
                "intermediate_size": intermediate_size or target.cfg.intermediate_size}
        bad = {k: getattr(head.cfg, k) for k, v in want.items() if getattr(head.cfg, k) != v}
        if bad:
            raise ValueError(f"--init {init}: the head has {bad}, this run asks for "
                             f"{ {k: want[k] for k in bad} }")
        head.cfg = Eagle3Config(**{**head.cfg.__dict__, "ttt_steps": steps})
        return head
    cfg = Eagle3Config.for_target(target, layers, draft_vocab, intermediate_size)
    cfg = Eagle3Config(**{**cfg.__dict__, "ttt_steps": steps})
    head = Eagle3Head(cfg, target).float()
    counts = torch.tensor(dist.sum(token_counts(train, cfg.vocab_size).tolist()), dtype=torch.long)
    d2t, t2d = choose_vocab(counts, cfg.draft_vocab_size)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    with torch.no_grad():
        out_w = target.output_weight().detach().float()
        head.lm_head.weight.copy_(out_w[head.to_target_ids(torch.arange(cfg.draft_vocab_size))])
        head.norm.copy_(target.norm.detach().float())
    return head


def train(data_dir: str, target: LlamaModel, out_dir: str, *, draft_vocab: int = 8192, steps: int = 7,
          max_minutes: float | None = 60.0, max_updates: int | None = None, lr: float = 1e-3, batch: int = 4,
          max_len: int = 768, holdout: float = 0.05, seed: int = 0, intermediate_size: int | None = None,
          eval_every: int = 50, save_every: int = 100, resume: bool = True, dist: Dist | None = None,
          progress: bool = True, init: str | None = None, amp: str = "off") -> dict:
    """Train a head on this rank's share of `data_dir` (`batch` sequences per rank and step), checkpointing into
    out_dir (resumed from the newest checkpoint there); rank 0 writes the head and its log."""
    dist = dist or Dist.single("cpu")
    torch.manual_seed(seed)
    meta = read_meta(data_dir)
    layers = eagle3_layers(target.cfg.num_layers)
    # a sequence needs response positions inside the first max_len tokens (long prompts are truncated away)
    data = rank_data(data_dir, dist, layers, holdout, seed,
                     usable=lambda r: min(r.length, max_len) - r.prompt_len >= 2)
    head = make_head(target, data.train, dist, draft_vocab, steps, intermediate_size, init).to(dist.device)
    out_w = target.output_weight().detach().float().to(dist.device)
    task = Eagle3Task(head, data.train, data.held, out_w, steps, max_len, progress and dist.is_writer, data_dir)
    loop = LoopConfig(steps=max_updates, max_minutes=None if max_updates else max_minutes, lr=lr, warmup=20,
                      final_lr=0.05, weight_decay=0.0, grad_clip=0.5, accum=batch, eval_every=eval_every,
                      save_every=save_every, seed=seed, amp=amp)
    fingerprint = {"data": str(Path(data_dir).resolve()), "sequences": meta.get("num_sequences"),
                   "head": repr(head.cfg), "max_len": max_len, "init": init, "holdout": holdout}
    log = train_loop(task, loop, dist, out_dir, fingerprint, resume=resume, progress=progress)
    info = {"method": "eagle3", "data": str(data_dir), "data_meta": {k: meta.get(k) for k in ("model", "prompt_files",
            "num_sequences", "tokens")}, "updates": log["steps"], "sequences_per_update": batch * dist.world,
            "world_size": dist.world, "train_sequences": data.train_total, "heldout_sequences": data.held_total,
            "wall_s": log["wall_seconds"], "threads": torch.get_num_threads(), "lr": lr, "ttt_steps": steps,
            "draft_vocab": head.cfg.draft_vocab_size, "train_tokens": log["train_tokens"],
            "train_tokens_per_s": log["train_tokens_per_s"], "heldout_before": log["heldout"][0],
            "heldout_after": log["heldout"][-1], "heldout_curve": log["heldout"],
            "curve": log["loss"][:: max(1, len(log["loss"]) // 200)], "resumed_at": log.get("resumed_at", []),
            "init": init, "amp": log["amp"], "soft_labels_from_cache": task.labels_cached}
    if dist.is_writer:
        head.save_pretrained(out_dir, {"target": meta.get("model")})
        (Path(out_dir) / "train_log.json").write_text(json.dumps(info, indent=1))
    dist.barrier()
    return info


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="directory written by `verispec train data`")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary size (d2t / t2d)")
    p.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll length")
    p.add_argument("--max-minutes", type=float, default=55.0, help="training-time budget (summed over resumed runs)")
    p.add_argument("--updates", type=int, default=None, help="train for exactly this many updates instead")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=4, help="sequences per update and rank (gradient accumulation)")
    p.add_argument("--eval-every", type=int, default=50, help="updates between held-out evaluations")
    p.add_argument("--max-len", type=int, default=768, help="truncate sequences to this many tokens")
    p.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, help="start from this trained head (a directory or shipped name) instead "
                   "of a fresh one: more training on new data; its draft vocabulary is kept")
    loop_args(p)


def run(args: argparse.Namespace) -> dict:
    """`verispec train eagle3`, in one process or on every rank of a torchrun launch."""
    from verispec.models.loader import load_model

    dist = Dist.from_env(args.device)
    target, _ = load_model(args.model or read_meta(args.data)["model"], dtype=args.dtype, device=dist.device)
    try:
        return train(args.data, target, args.out, draft_vocab=args.draft_vocab, steps=args.ttt_steps,
                     max_minutes=args.max_minutes, max_updates=args.updates, lr=args.lr, batch=args.batch,
                     max_len=args.max_len, seed=args.seed, intermediate_size=args.intermediate_size,
                     eval_every=args.eval_every, save_every=args.save_every, resume=not args.no_resume, dist=dist,
                     init=None if args.init is None else str(resolve_drafter(args.init)), amp=args.amp,
                     **({} if args.holdout is None else {"holdout": args.holdout}))
    finally:
        dist.close()
