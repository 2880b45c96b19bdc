"""A model-free drafter first, a model drafter where its draft is not worth verifying (the hybrid the SuffixDecoding
paper runs beside a model-based speculator; the rule here is the engine's policy).

The request's drafter has two sides. Each step the engine asks the model-free side (n-gram or suffix: microseconds)
first, under the request's estimate for it; where the policy verifies none of that draft, the engine switches the
request to the model side (EAGLE-3, DFlash, DSpark, a draft model, MTP layers), with an estimate and a drafting
time of its own, and asks again (engine/core.py `_draft`, engine/plan.py `LiveRequest.switch_side`). So repeated
parts of an output (records, templates, code copied from the prompt) are drafted for free and the rest by the model
where the policy finds that it pays. Whichever draft goes into the forward is verified like any other, with its own
draft distribution (none for the model-free side's deterministic drafts), and which side drafts depends only on the
committed tokens and the estimates, never on the step's random draws: greedy output equals plain decoding's and
sampling stays exact.

State: the model side hears the features of every committed position whichever side drafted (learned drafters catch
up at their next proposal on the positions they did not draft, as after steps without speculation); each side hears
the verdict on its own drafts only; both are released with the finished stream.
"""

from __future__ import annotations

from typing import Sequence

import torch

from verispec.drafters.base import Draft, Drafter


class HybridDrafter:
    """`free` (a model-free drafter) and `model`; `use_model` (set by the engine) says which one proposes."""

    name = "hybrid"

    def __init__(self, free: Drafter, model: Drafter) -> None:
        self.free, self.model = free, model
        self.use_model = False
        self.feature_layers: tuple[int, ...] = tuple(getattr(model, "feature_layers", ()))
        # the model-free side's traits; the engine keeps the model side's with that side's estimate
        self.gives_confidence = getattr(free, "gives_confidence", True)
        self.drafts_in_one_pass = getattr(free, "drafts_in_one_pass", False)
        self.stops_early = getattr(free, "stops_early", False)  # propose passes min_survival to a side that takes it
        self.last: Drafter | None = None  # the side whose draft the next verdict is about
        self.proposals = {"free": 0, "model": 0}  # drafts with tokens each side gave (for reports)
        if getattr(model, "check_own_state", None) is not None:
            self.check_own_state = model.check_own_state  # type: ignore[attr-defined]

    def propose(self, context: Sequence[int], k: int, min_survival: float = 0.0) -> Draft:
        side = self.model if self.use_model else self.free
        stops = min_survival > 0 and getattr(side, "stops_early", False)
        d = side.propose(context, k, min_survival=min_survival) if stops else side.propose(context, k)
        if d.tokens:
            self.last = side
            self.proposals["model" if self.use_model else "free"] += 1
        return d

    def observe(self, accepted: int) -> None:
        if self.last is not None:
            self.last.observe(accepted)
        self.last = None

    def add_features(self, feats: torch.Tensor) -> None:
        self.model.add_features(feats)  # type: ignore[attr-defined]

    def check_state(self, ref: torch.Tensor, tokens: Sequence[int]) -> None:
        self.model.check_state(ref, tokens)  # type: ignore[attr-defined]

    def release(self, tokens: Sequence[int] | None = None) -> None:
        try:
            self.free.release(tokens)
        finally:
            self.model.release(tokens)
