"""DFlash 2's idea, our implementation: a small parallel path selector over the block drafter's candidates.

DFlash drafts every block position at once, so position k knows nothing of the token chosen at k - 1. The selector
keeps the top-m candidates of each position and re-scores them with two cheap terms, computed for the whole block in
one pass (no serial network):

  unary   u_k(c)      = a_k * log q_k(c) + <W_c e(c), W_h conv(h)_k>       [g, m]
  pair    b(p, c)     = <W_l e(p), W_r e(c)> / sqrt(r)                      [g, m(_prev), m]  (rank-r bilinear)
  step    log s_k(c | p) = log_softmax over the m candidates of u_k(c) + b(p, c)

q_k is DFlash's own distribution at block position k, h_k its final hidden state there, conv a two-tap depthwise
convolution along the block (h_k + t * h_{k-1}), e the target's frozen token embedding; p is the token chosen at
k - 1 (the anchor for k = 1). Greedy drafting walks the block left to right taking the best candidate given the
previous choice (g argmaxes over m numbers); sampling draws from s_k at the sampler's temperature and returns it,
scattered over the vocabulary, as the draft distribution q for the rejection test; trees expand each node's best
children under s_k, scored s_k(c | p) * q_k(top m) (the selector ranks within the candidates; DFlash says how
likely the right token is among them at all, which keeps deep and wide nodes comparable). Trained on the self-distillation data with the drafter frozen (train/selector.py):
cross-entropy over the m candidates, teacher-forced on the data's previous token.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from verispec.sampling import DraftSampler

# the target's token embedding as the selector reads it: a dense [V, d] table, or a function of ids [...] -> rows
# [..., d] (dflash_model.TargetParts.rows: a GGUF target's rows dequantised as looked up, no dense table)
Embed = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


def lookup(embed: Embed, ids: torch.Tensor) -> torch.Tensor:
    """ids [...] -> [..., d] rows of `embed`."""
    return F.embedding(ids, embed) if isinstance(embed, torch.Tensor) else embed(ids)

FILES = ("path_selector.json", "path_selector.safetensors")  # stored next to the DFlash checkpoint's own files


@dataclass(frozen=True)
class SelectorConfig:
    hidden_size: int
    vocab_size: int
    positions: int  # block positions drafted (block_size - 1)
    top_m: int = 8
    rank: int = 64


@dataclass
class Lattice:
    """One block's candidates and scores. cand: [g, m] token ids; unary: [g, m]; right: [g, m, r] W_r e(c);
    mass: [g] log of the probability DFlash puts on each position's m candidates."""

    cand: torch.Tensor
    unary: torch.Tensor
    right: torch.Tensor
    mass: torch.Tensor



class PathSelector(nn.Module):
    def __init__(self, cfg: SelectorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, r = cfg.hidden_size, cfg.rank
        self.w_c = nn.Linear(d, r, bias=False)
        self.w_h = nn.Linear(d, r, bias=False)
        self.w_l = nn.Linear(d, r, bias=False)
        self.w_r = nn.Linear(d, r, bias=False)
        self.tap = nn.Parameter(torch.zeros(d))  # the two-tap convolution's weight on h_{k-1}
        self.alpha = nn.Parameter(torch.ones(cfg.positions))  # a_k: trust in DFlash's own log-probabilities
        for w in (self.w_c, self.w_h, self.w_l, self.w_r):
            nn.init.normal_(w.weight, std=0.02)  # starts close to DFlash's own ranking

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def context(self, h: torch.Tensor) -> torch.Tensor:
        """h: [..., g, d] -> conv(h): [..., g, d] = h_k + tap * h_{k-1} (h_0 = 0)."""
        prev = F.pad(h, (0, 0, 1, 0))[..., :-1, :]
        return h + self.tap * prev

    def left(self, emb: torch.Tensor) -> torch.Tensor:
        """[..., d] token embeddings -> W_l e / sqrt(r): [..., r] (the previous token's side of the pair term)."""
        return self.w_l(emb) / math.sqrt(self.cfg.rank)

    def scores(self, vals: torch.Tensor, cand: torch.Tensor, h: torch.Tensor, embed: Embed
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """vals, cand: [..., g, m] DFlash's top-m log-probabilities and their tokens, h: [..., g, d] ->
        (unary [..., g, m], right [..., g, m, r]); the batch dims are any (training runs many anchors at once)."""
        g = vals.shape[-2]
        e = lookup(embed, cand).to(self.w_c.weight.dtype)  # [..., g, m, d]
        ctx = self.w_h(self.context(h.to(self.w_h.weight.dtype)))  # [..., g, r]
        unary = self.alpha[:g, None] * vals.to(ctx.dtype) + (self.w_c(e) * ctx.unsqueeze(-2)).sum(-1)
        return unary, self.w_r(e)

    def step_logits(self, unary: torch.Tensor, right: torch.Tensor, prev: torch.Tensor, embed: Embed
                    ) -> torch.Tensor:
        """Teacher-forced: unary [..., g, m], right [..., g, m, r], prev [..., g] the token before each position ->
        u_k(c) + b(prev_k, c): [..., g, m]."""
        left = self.left(lookup(embed, prev).to(right.dtype))  # [..., g, r]
        return unary + (right @ left.unsqueeze(-1)).squeeze(-1)

    def next_logits(self, lat: Lattice, k: int, prev: int, embed: Embed) -> torch.Tensor:
        """[m] u_k(c) + b(prev, c) over position k's candidates, after token `prev` (float32)."""
        e = lookup(embed, torch.tensor(prev, device=lat.cand.device))  # [d]
        left = self.left(e.to(self.w_l.weight.dtype)).float()  # [r]
        return lat.unary[k] + lat.right[k] @ left

    @torch.no_grad()
    def lattice(self, logits: torch.Tensor, h: torch.Tensor, embed: Embed) -> Lattice:
        """One block at inference: logits [g, V] (DFlash's U), h [g, d] -> its Lattice."""
        vals, cand = torch.log_softmax(logits.float(), -1).topk(self.cfg.top_m, dim=-1)  # [g, m]
        unary, right = self.scores(vals, cand, h, embed)
        return Lattice(cand, unary.float(), right.float(), torch.logsumexp(vals, -1))

    # ---- checkpoint -------------------------------------------------------------------------------------------
    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / FILES[0]).write_text(json.dumps({**asdict(self.cfg), **(extra or {})}, indent=1))
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(d / FILES[1]))

    @classmethod
    def load(cls, directory: str | Path) -> "PathSelector | None":
        """The selector stored in a DFlash checkpoint directory, or None when it holds none."""
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / FILES[0]).is_file():
            return None
        raw = json.loads((d / FILES[0]).read_text())
        sel = cls(SelectorConfig(**{k: raw[k] for k in SelectorConfig.__dataclass_fields__ if k in raw}))
        sel.load_state_dict(load_file(str(d / FILES[1])))
        return sel.eval().requires_grad_(False)


def walk(lat: Lattice, selector: PathSelector, embed: Embed, anchor: int, g: int,
         temperature: float = 0.0, sampler: DraftSampler | None = None, position: int = 0
         ) -> tuple[list[int], list[torch.Tensor]]:
    """Left to right over g positions: greedy (temperature 0) the best candidate given the previous choice, else a
    draw from softmax(step / temperature) over the m candidates. Returns the tokens and, when sampling, each
    position's distribution over the m candidates [m]. sampler: the request's draws (a seeded request's coupled to
    the noise of the candidates' token ids at absolute position `position` + k)."""
    tokens: list[int] = []
    dists: list[torch.Tensor] = []
    prev = anchor
    for k in range(g):
        z = selector.next_logits(lat, k, prev, embed)  # [m]
        if temperature <= 0:
            j = int(z.argmax())
        else:
            q = torch.softmax(z / temperature, -1)
            assert sampler is not None, "sampling needs the request's draft sampler"
            j = sampler.among(q, lat.cand[k], position + k)
            dists.append(q)
        prev = int(lat.cand[k, j])
        tokens.append(prev)
    return tokens, dists
