"""The DFlash / DSpark drafter of one request (a FeatureDrafter, see base.py).

State: per draft layer, the context K/V of the committed positions (rotated keys, values), [cap, K, hd] buffers
plus one length counter `n`. add_features() projects each newly committed position's target features once and
appends its K/V; a draft block is computed on the fly from the cached context and never stored, so rejected
drafts cannot leak into later steps and observe() is bookkeeping only.

propose(context, k): one block forward with anchor = context[-1] at position len(context) - 1 over the n =
len(context) - 1 cached context positions; returns min(k, B - 1) tokens.
  greedy   DFlash: argmax per position. DSpark: left to right, argmax(U_k + B_k) with B_k read from the token
           chosen at k - 1.
  sampled  each position is drawn from its processed distribution (temperature, top-k, top-p as the target's
           sampler), returned as Draft.probs [g, V] for the rejection sampler; DSpark's q_k is conditioned on
           the token drawn at k - 1.
  DSpark also returns the calibrated per-position confidences c_1..c_g.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from verispec.drafters.base import EMPTY, Draft
from verispec.drafters.dflash_model import DFlashConfig, DFlashModel, TargetParts  # noqa: F401 (re-exported)
from verispec.drafters.dspark_head import calibrated_confidence
from verispec.execution.sampling import SamplingParams, target_probs


def load(path: str | Path, target) -> DFlashModel:
    """A trained DFlash / DSpark checkpoint for `target`, in the target's dtype and device."""
    return DFlashModel.from_pretrained(path, target)


class DFlashDrafter:
    def __init__(self, model: DFlashModel, params: SamplingParams) -> None:
        self.model, self.params, self.cfg = model, params, model.cfg
        self.name = "dspark" if model.cfg.dspark else "dflash"
        self.feature_layers = model.cfg.feature_layers
        self.device = model.fc.weight.device
        self.n = 0  # committed positions whose context K/V is cached
        self._k: list[torch.Tensor] = []  # per layer [cap, K, hd]
        self._v: list[torch.Tensor] = []
        self.generator = None if params.greedy else params.make_generator(self.device, stream="dflash")
        self.released = False

    # ---- state -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def add_features(self, feats: torch.Tensor) -> None:
        """feats: [m, len(feature_layers) d], the next m committed positions' target features."""
        assert not self.released, "the drafter was released"
        m = feats.shape[0]
        if m == 0:
            return
        pos = torch.arange(self.n, self.n + m, device=self.device)
        kv = self.model.context_kv(feats.to(self.device), pos)
        self._reserve(self.n + m, kv[0][0])
        for li, (k, v) in enumerate(kv):
            self._k[li][self.n : self.n + m] = k
            self._v[li][self.n : self.n + m] = v
        self.n += m

    def _reserve(self, need: int, like: torch.Tensor) -> None:
        cap = self._k[0].shape[0] if self._k else 0
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, 64)
        for bufs in (self._k, self._v):
            for li in range(self.cfg.num_layers):
                grown = like.new_empty((new_cap, *like.shape[1:]))  # [new_cap, K, hd]
                if cap:
                    grown[:cap] = bufs[li][:cap]
                if li < len(bufs):
                    bufs[li] = grown
                else:
                    bufs.append(grown)

    def observe(self, accepted: int) -> None:
        """Nothing to roll back: drafts are never cached; the accepted positions arrive via add_features."""

    def check_state(self, ref: torch.Tensor, tokens: Sequence[int] | None = None) -> None:
        """ref: [n, len(feature_layers) d] features recomputed from scratch; the cached K/V must match them."""
        n = ref.shape[0]
        if self.n != n:
            raise AssertionError(f"{self.name}: the drafter holds context K/V for {self.n} positions but {n} "
                                 "positions are committed")
        if n == 0:
            return
        atol = 1e-4 if self.model.dtype == torch.float32 else 5e-2
        with torch.inference_mode():
            fresh = self.model.context_kv(ref.to(self.device), torch.arange(n, device=self.device))
        for li, (k, v) in enumerate(fresh):
            for what, live, want in (("K", self._k[li], k), ("V", self._v[li], v)):
                diff = (live[:n].float() - want.float()).abs().amax(dim=(1, 2))  # [n]
                bad = (diff > atol).nonzero()
                if bad.numel():
                    p = int(bad[0, 0])
                    raise AssertionError(f"{self.name}: context {what} of draft layer {li} differs at position {p} "
                                         f"of {n} (max abs diff {float(diff[p]):.3g} > {atol:g})")

    def release(self) -> None:
        self._k, self._v = [], []
        self.released = True

    # ---- drafting ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def block(self, anchor: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One block forward: anchor at position pos over the cached context -> h [B, d], U [B - 1, V]."""
        B = self.cfg.block_size
        x = self.model.block_inputs(torch.tensor([anchor], device=self.device))[0]  # [B, d]
        ctx = [(k[: self.n], v[: self.n]) for k, v in zip(self._k, self._v)] if self.n else self._empty_ctx(x)
        h = self.model.block_hidden(x, torch.arange(pos, pos + B, device=self.device), ctx, None)  # [B, d]
        return h, self.model.logits(h[1:])

    def _empty_ctx(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        e = x.new_zeros((0, self.cfg.num_kv_heads, self.cfg.head_dim))
        return [(e, e)] * self.cfg.num_layers

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Draft:
        assert not self.released, "the drafter was released"
        n = len(context) - 1
        assert self.n == n, (f"{self.name}: holds features for {self.n} positions but the context of "
                             f"{len(context)} tokens needs exactly {n} (add_features must follow every commit)")
        B = self.cfg.block_size
        if k <= 0 or n < 0 or n + B > self.model.parts.max_positions:
            return EMPTY
        g = min(k, B - 1)
        h, U = self.block(int(context[-1]), n)  # [B, d], [B - 1, V]
        p = self.params
        if self.model.markov is None:
            if p.greedy:
                return Draft(U[:g].argmax(-1).tolist())
            q = target_probs(U[:g], p.temperature, p.top_k, p.top_p)  # [g, V]
            return Draft(torch.multinomial(q, 1, generator=self.generator).squeeze(-1).tolist(), q)
        qs: list[torch.Tensor] = []

        def choose(z: torch.Tensor, _k: int) -> torch.Tensor:  # z: [1, V] -> [1]
            if p.greedy:
                return z.argmax(-1)
            qs.append(target_probs(z, p.temperature, p.top_k, p.top_p)[0])
            return torch.multinomial(qs[-1], 1, generator=self.generator)

        anchor = torch.tensor([int(context[-1])], device=self.device)
        toks, _, conf = self.model.markov.decode(U[None, :g], h[None, 1 : g + 1], anchor, choose)
        c = calibrated_confidence(conf[0], self.cfg.confidence_temperatures)  # [g]
        return Draft(toks[0].tolist(), torch.stack(qs) if qs else None, c.tolist())
