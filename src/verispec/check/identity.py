"""Greedy identity: is the speculative output token-identical to the plain one, and if not, is it a near-tie?

At temperature 0 both paths take the target's argmax, but a block of several tokens is computed with other
matmul shapes than one token at a time, so logits differ in the last bits (fp32 ~1e-5, bf16 far more). A
divergence is a bug unless the target's top-1 / top-2 logit margin at that position is within that noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from verispec.models.llama import LlamaModel

NEAR_TIE = 1e-3  # fp32 margin below which a divergence is attributed to arithmetic, not to the algorithm
# bf16 logits move by up to ~0.5 with the number of tokens computed together (docs/measuring.md), and tie exactly often
NEAR_TIE_BY_DTYPE = {torch.float32: NEAR_TIE, torch.bfloat16: 0.5, torch.float16: 0.1}


@dataclass(frozen=True)
class Divergence:
    position: int  # index into the output tokens
    expected: int  # the plain path's token
    got: int  # the speculative path's token
    margin: float  # target's top-1 minus top-2 logit at that position (recomputed from scratch)
    threshold: float = NEAR_TIE  # the numerical noise bound of the dtype the margin was computed in

    @property
    def near_tie(self) -> bool:
        return self.margin < self.threshold

    def __str__(self) -> str:
        kind = f"near-tie, < {self.threshold:g}" if self.near_tie else f"BUG: margin >= {self.threshold:g}"
        return (f"first divergence at output position {self.position}: plain {self.expected}, speculative "
                f"{self.got}; target top-1/top-2 margin {self.margin:.3g} ({kind})")


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, the shorter length if one is a prefix of the other, else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def common_prefix_fraction(a: Sequence[int], b: Sequence[int]) -> float:
    i = first_divergence(a, b)
    longest = max(len(a), len(b))
    return 1.0 if i is None or longest == 0 else i / longest


def top2_margin(model: LlamaModel, tokens: Sequence[int]) -> float:
    """The target's top-1 minus top-2 logit for the token after `tokens`, from a fresh forward."""
    _, _, out = model.prefill_fresh(tokens)
    top = out.logits[0].topk(2).values  # [2]
    return float(top[0] - top[1])


def compare_greedy(model: LlamaModel, prompt: Sequence[int], plain: Sequence[int],
                   speculative: Sequence[int]) -> Divergence | None:
    i = first_divergence(plain, speculative)
    if i is None:
        return None
    got = speculative[i] if i < len(speculative) else -1
    exp = plain[i] if i < len(plain) else -1
    threshold = NEAR_TIE_BY_DTYPE.get(model.dtype, NEAR_TIE)
    return Divergence(i, exp, got, top2_margin(model, list(prompt) + list(plain[:i])), threshold)
