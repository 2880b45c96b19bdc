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
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from verispec.drafters.eagle3 import Eagle3Config, Eagle3Head
from verispec.drafters.features import eagle3_layers
from verispec.models.llama import LlamaModel
from verispec.train.shards import TrainSequence, load_all, read_meta, target_logits

DECAY = 0.8


def build_vocab(seqs: list[TrainSequence], size: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent response tokens (ties: lower id; padded with the lowest unused ids).
    Returns d2t [size] (target id = draft id + d2t) and t2d [vocab] bool."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.ids[s.prompt_len :], minlength=vocab)[:vocab]
    order = sorted(range(vocab), key=lambda t: (-int(counts[t]), t))[:size]
    chosen = torch.tensor(sorted(order), dtype=torch.long)
    d2t = chosen - torch.arange(size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


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
    with torch.no_grad():
        p = torch.softmax(target_logits(seq.last_hidden[:max_len], out_w).float(), dim=-1)  # [T, V]
        probs, ids = p.topk(TOPK, dim=-1)
    return SoftLabels(ids, probs)


def sequence_loss(head: Eagle3Head, seq: TrainSequence, lab: SoftLabels, steps: int, max_len: int
                  ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Weighted soft cross-entropy of one sequence; also (correct top-1, counted) per step for accuracy.
    The target distribution is its top-TOPK mass restricted to the draft vocabulary (mass elsewhere is dropped)."""
    ids = seq.ids[:max_len]
    T = ids.shape[0]
    feats = seq.features(head.feature_layers)[:T]
    with torch.no_grad():
        t2d_index = torch.cumsum(head.t2d.long(), 0) - 1  # [V] draft id of a target id (valid where t2d)
        in_draft = head.t2d[lab.ids]  # [T, TOPK]
        draft_of = torch.where(in_draft, t2d_index[lab.ids], 0)  # [T, TOPK]
        weight = lab.probs * in_draft  # [T, TOPK]
        top_t = lab.ids[:, 0]  # [T] the target's greedy token
    logits = ttt_logits(head, feats, ids, steps)
    n = T - 1
    j = torch.arange(n)
    total = torch.zeros(())
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


def evaluate(head: Eagle3Head, seqs: list[TrainSequence], labels: list[SoftLabels], steps: int, max_len: int
             ) -> dict:
    head.eval()
    loss, right, count = 0.0, [0] * steps, [0] * steps
    with torch.no_grad():
        for s, lab in zip(seqs, labels):
            l, acc = sequence_loss(head, s, lab, steps, max_len)
            loss += float(l)
            for i, (a, c) in enumerate(acc):
                right[i] += a
                count[i] += c
    head.train()
    accs = [r / c if c else 0.0 for r, c in zip(right, count)]
    return {"loss": loss / max(1, len(seqs)), "top1_per_step": [round(a, 4) for a in accs],
            "conditional_tau_estimate": round(expected_tau(accs), 3)}


def train(data_dir: str, target: LlamaModel, out_dir: str, *, draft_vocab: int = 8192, steps: int = 7,
          max_minutes: float = 60.0, max_updates: int | None = None, lr: float = 1e-3, batch: int = 4,
          max_len: int = 768, holdout: float = 0.05, seed: int = 0, intermediate_size: int | None = None,
          progress: bool = True) -> dict:
    torch.manual_seed(seed)
    meta = read_meta(data_dir)
    seqs = load_all(data_dir)
    # a sequence needs response positions inside the first max_len tokens (long prompts are truncated away)
    seqs = [s for s in seqs if min(len(s.ids), max_len) - s.prompt_len >= 2]
    if len(seqs) < 2:
        raise ValueError(f"{data_dir} holds {len(seqs)} usable sequences; generate more with `verispec train data`")
    rng = random.Random(seed)
    rng.shuffle(seqs)
    n_hold = max(1, int(len(seqs) * holdout))
    held, train_seqs = seqs[:n_hold], seqs[n_hold:]
    layers = eagle3_layers(target.cfg.num_layers)
    cfg = Eagle3Config.for_target(target, layers, draft_vocab, intermediate_size)
    cfg = Eagle3Config(**{**cfg.__dict__, "ttt_steps": steps})
    head = Eagle3Head(cfg, target).float()
    d2t, t2d = build_vocab(train_seqs, cfg.draft_vocab_size, cfg.vocab_size)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    out_w = target.output_weight().detach().float()
    with torch.no_grad():  # start from the target's own output layer (its rows for the draft vocabulary)
        head.lm_head.weight.copy_(out_w[head.to_target_ids(torch.arange(cfg.draft_vocab_size))])
        head.norm.copy_(target.norm.detach().float())
    head.train()
    start = time.perf_counter()
    labels = [soft_labels(q, out_w, max_len) for q in tqdm(held + train_seqs, desc="soft labels", unit="seq",
                                                              disable=not progress)]  # once, inside the budget
    held_labels, train_labels = labels[: len(held)], labels[len(held) :]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    budget = max_minutes * 60
    est_updates = max_updates or max(1, int(budget / 5))  # refined below from the measured update time
    log: list[dict] = []
    update = 0
    bar = tqdm(total=max_updates, desc="eagle3", unit="update", disable=not progress)
    before = evaluate(head, held, held_labels, steps, max_len)
    curve = [{"update": 0, "s": round(time.perf_counter() - start, 1), **before}]
    t_train = time.perf_counter()
    eval_s = 0.0  # time spent on held-out evaluation, kept out of the pace estimate
    next_eval = 1
    while True:
        elapsed = time.perf_counter() - start
        if (max_updates is not None and update >= max_updates) or (max_updates is None and elapsed >= budget):
            break
        if max_updates is None and update in (5, 50):  # time-budgeted: set the schedule length from the pace
            pace = (time.perf_counter() - t_train - eval_s) / update  # seconds per update, evaluation excluded
            est_updates = max(update + 1, int((budget - (t_train - start)) / pace))
        frac = min(1.0, update / est_updates)
        if frac >= next_eval / 8 and next_eval < 8:  # a held-out learning curve at eighths of the run
            t0 = time.perf_counter()
            curve.append({"update": update, "s": round(t0 - start, 1), **evaluate(head, held, held_labels, steps,
                                                                                   max_len)})
            eval_s += time.perf_counter() - t0
            next_eval += 1
        for g in opt.param_groups:  # warm-up, then cosine down to 5% of lr
            g["lr"] = lr * min(1.0, (update + 1) / 20) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        opt.zero_grad()
        tot = 0.0
        for _ in range(batch):
            k = rng.randrange(len(train_seqs))
            loss, _ = sequence_loss(head, train_seqs[k], train_labels[k], steps, max_len)
            if not loss.requires_grad:  # no position to learn from (cannot happen after the filter above)
                continue
            (loss / batch).backward()
            tot += float(loss.detach()) / batch
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        update += 1
        log.append({"update": update, "loss": round(tot, 5), "s": round(time.perf_counter() - start, 1)})
        bar.update(1)
        bar.set_postfix(loss=f"{tot:.3f}")
    bar.close()
    wall = time.perf_counter() - start
    after = evaluate(head, held, held_labels, steps, max_len)
    curve.append({"update": update, "s": round(wall, 1), **after})
    info = {"method": "eagle3", "data": str(data_dir), "data_meta": {k: meta.get(k) for k in ("model", "prompt_files",
            "num_sequences", "tokens")}, "updates": update, "sequences_per_update": batch,
            "train_sequences": len(train_seqs), "heldout_sequences": len(held), "wall_s": round(wall, 1),
            "threads": torch.get_num_threads(), "lr": lr, "ttt_steps": steps, "draft_vocab": cfg.draft_vocab_size,
            "heldout_before": before, "heldout_after": after, "heldout_curve": curve,
            "curve": log[:: max(1, len(log) // 200)]}
    head.save_pretrained(out_dir, {"target": meta.get("model")})
    (Path(out_dir) / "train_log.json").write_text(json.dumps(info, indent=1))
    return info


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="directory written by `verispec train data`")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary size (d2t / t2d)")
    p.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll length")
    p.add_argument("--max-minutes", type=float, default=55.0, help="wall-clock training budget")
    p.add_argument("--updates", type=int, default=None, help="train for exactly this many updates instead")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=4, help="sequences per update")
    p.add_argument("--max-len", type=int, default=768, help="truncate sequences to this many tokens")
    p.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace, target: LlamaModel) -> dict:
    return train(args.data, target, args.out, draft_vocab=args.draft_vocab, steps=args.ttt_steps,
                 max_minutes=args.max_minutes, max_updates=args.updates, lr=args.lr, batch=args.batch,
                 max_len=args.max_len, seed=args.seed, intermediate_size=args.intermediate_size)
