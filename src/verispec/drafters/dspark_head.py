"""DSpark's two small heads on top of the DFlash backbone (docs/methods.md section 6).

Markov head (semi-autoregressive correction of the parallel block):
  p_k = softmax(U_k + B_k),  B_k = W2 W1[x_{k-1}]     U_k: the backbone's logits at block position k
                                                      W1: V x r token embedding, W2: r -> V (r = 256 by default)
  x_0 is the anchor token; x_{k-1} for k >= 2 is the token CHOSEN at position k-1, so decoding runs left to right
  (one [r] lookup and one r x V matvec per position). Training feeds the data token (teacher forcing).
Confidence head:
  c_k = sigmoid(w^T [h_k ; W1 x_{k-1}] / T_k)         h_k: the backbone's final hidden state at block position k
  T_k: per-position temperatures from calibration (1 before it). c_k estimates the probability that position k
  survives verification given that position k - 1 did; the cumulative product is the survival probability.
  Deviation: w has a bias term (the paper writes w^T [..]); it lets an untrained head start at any base rate.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from verispec.sampling import argmax_rows
from verispec.models.linear import residual_linear


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank)  # W1: [V, r]
        self.w2 = nn.Linear(rank, vocab_size, bias=False)  # W2: weight [V, r]
        self.confidence = nn.Linear(hidden_size + rank, 1)  # w: [1, d + r] (+ bias)
        nn.init.normal_(self.w1.weight, std=0.02)
        nn.init.zeros_(self.w2.weight)  # B_k = 0 at the start: the head begins as plain DFlash
        nn.init.normal_(self.confidence.weight, std=0.02)
        nn.init.zeros_(self.confidence.bias)

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev: [...] token ids x_{k-1} -> B_k: [..., V] in the head's dtype."""
        return self.w2(self.w1(prev))

    def conf_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h: [..., d] block hidden states at positions k, prev: [...] x_{k-1} -> raw confidence logits [...]."""
        return self.confidence(torch.cat([h, self.w1(prev).to(h.dtype)], dim=-1)).squeeze(-1)

    def decode(
        self,
        U: torch.Tensor,
        h: torch.Tensor,
        anchor: torch.Tensor,
        choose: Callable[[torch.Tensor, int], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-to-right decoding of g positions for A blocks at once.

        U: [A, g, V] backbone logits at block positions 1..g; h: [A, g, d] their hidden states; anchor: [A] x_0.
        choose(z [A, V], k) -> [A] tokens picks position k (0-based) from its corrected logits z = U_k + B_k.
        Returns tokens [A, g], corrected logits z [A, g, V] (float32) and raw confidence logits [A, g].
        """
        A, g, _ = U.shape
        prev = anchor
        toks, zs, confs = [], [], []
        for k in range(g):
            z = U[:, k].float() + self.bias(prev).float()  # [A, V]
            confs.append(self.conf_logits(h[:, k], prev).float())  # [A]
            prev = choose(z, k)  # [A]
            toks.append(prev)
            zs.append(z)
        return torch.stack(toks, 1), torch.stack(zs, 1), torch.stack(confs, 1)

    def greedy(self, U: torch.Tensor, h: torch.Tensor, anchor: int, vocab=None) -> tuple[list[int], torch.Tensor]:
        """`decode` of one block with argmax, in fewer ops: x_k = argmax(U_k + B_k), where W2 runs on verispec's
        kernel (a Q8ActWeight) with U_k as the residual of its own call (the same float sum), and the confidences
        of all positions in one call after the walk. U: [g, V] float32 backbone logits, h: [g, d] hidden states,
        anchor: x_0; vocab: a draft vocabulary (drafters/draft_vocab.py): U then holds its tokens' logits [g, Vd]
        and B_k is taken over them only (their rows of W2). Returns the tokens (g) and the raw confidence logits
        [g]."""
        w2, ids = (self.w2, None) if vocab is None else (vocab.w2, vocab.ids)
        prev, toks = anchor, []
        for k in range(U.shape[0]):
            e = self.w1.weight[prev : prev + 1]  # [1, r]
            z = residual_linear(U[k : k + 1].float().contiguous(), e, w2, None)  # U_k + B_k: [1, V or Vd]
            j = argmax_rows(z)[0]
            prev = j if ids is None else int(ids[j])
            toks.append(prev)
        return toks, self.conf_logits(h, torch.tensor([anchor] + toks[:-1], device=h.device)).float()


def calibrated_confidence(conf_logits: torch.Tensor, temperatures: tuple[float, ...]) -> torch.Tensor:
    """conf_logits: [..., g] raw logits of positions 1..g -> per-position c_k = sigmoid(logit_k / T_k), [..., g]."""
    g = conf_logits.shape[-1]
    if not temperatures:
        return torch.sigmoid(conf_logits)
    t = torch.tensor(temperatures[:g], dtype=conf_logits.dtype, device=conf_logits.device)  # [g]
    return torch.sigmoid(conf_logits / t)


def soft_survival_label(p_draft: torch.Tensor, p_target: torch.Tensor) -> torch.Tensor:
    """[..., V] x 2 -> [...]: 1 - 0.5 ||p_d - p_t||_1 = 1 - TV, the probability a sampled draft token survives."""
    return (1 - 0.5 * (p_draft - p_target).abs().sum(-1)).clamp(0.0, 1.0)


def bce_confidence(conf_logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Elementwise BCE of sigmoid(conf_logits) against soft labels in [0, 1] (no reduction)."""
    return F.binary_cross_entropy_with_logits(conf_logits.float(), label.float(), reduction="none")
