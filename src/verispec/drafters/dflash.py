"""The DFlash / DSpark drafter of one request (a FeatureDrafter, see base.py).

State: per draft layer, the context K/V of the committed positions (rotated keys, values), [cap, K, hd] buffers
plus one length counter `n`. add_features() projects each newly committed position's target features once and
appends its K/V; a draft block is computed on the fly from the cached context and never counted as context (on
the kernel, drafters/dflash_kernel.py, its K/V are scratch rows past `n`), so rejected drafts cannot leak into later
steps and observe() is bookkeeping only.

propose(context, k): one block forward with anchor = context[-1] at position len(context) - 1 over the n =
len(context) - 1 cached context positions; returns min(k, B - 1) tokens.
  greedy   DFlash: argmax per position. DSpark: left to right, argmax(U_k + B_k) with B_k read from the token
           chosen at k - 1.
  sampled  each position is drawn from its processed distribution (temperature, top-k, top-p as the target's
           sampler), returned as Draft.probs [g, V] for the rejection sampler; DSpark's q_k is conditioned on
           the token drawn at k - 1.
  DSpark also returns the calibrated per-position confidences c_1..c_g.

propose_tree(context, budget, depth): the same block forward, then a tree of the `budget` most probable paths
(cumulative draft log-probability, EAGLE-2's selection), grown best first: a node's children are the TREE_TOPK
most probable tokens of the next block position. DFlash's block positions are drafted in parallel, so every node
of one depth draws from the same distribution; DSpark's Markov head corrects it by the node's own token
(U_k + B(token of the parent)), one small head call per expanded node; with DFlash 2's path selector a node's
children are the best of the position's top-m candidates given the node's token.

With a path selector (DFlash only, drafters/path_selector.py) propose() walks the selector's lattice instead of
taking each position's argmax / draw.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Sequence

import torch

from verispec.config import DEFAULT_DRAFT_QUANTIZATION
from verispec.drafters import draft_vocab
from verispec.drafters.base import EMPTY, Draft
from verispec.drafters.draft_vocab import DraftVocab
from verispec.drafters.dflash_model import DFlashConfig, DFlashModel, TargetParts  # noqa: F401 (re-exported)
from verispec.execution.features import own
from verispec.drafters.dspark_head import calibrated_confidence
from verispec.drafters.path_selector import walk
from verispec.drafters.tree_growth import draw_children
from verispec.sampling import SamplingParams, argmax_rows, target_probs
from verispec.models.tree import TreeDraft

TREE_TOPK = 4  # children considered per expanded node


def load(path: str | Path, target, inference: bool = True, kind: str | None = None) -> DFlashModel:
    """A trained DFlash / DSpark checkpoint for `target`, in the target's dtype and device; for inference beside a
    gguf-q8act target, on the same kernel with its linears in `kind` blocks (`DFlashModel.quantize_q8act`; None:
    config.DEFAULT_DRAFT_QUANTIZATION, what the engine loads), and
    with the draft vocabulary stored beside it where there is one (drafters/draft_vocab.py); `inference=False`:
    float, full vocabulary, to train or export."""
    model = DFlashModel.from_pretrained(path, target)
    ids = draft_vocab.read(path) if inference else None
    if ids is not None:  # built from the float weights, before any rounding
        w2 = model.markov.w2.weight if model.markov is not None else None
        model.vocab = DraftVocab(ids, model.parts.out_rows, model.parts.vocab_size, w2,
                                 kernel=target.decoder_kernel is not None)
    if inference and target.decoder_kernel is not None:
        model.quantize_q8act(target.head_weight, kind or DEFAULT_DRAFT_QUANTIZATION.upper())
    return model


class DFlashDrafter:
    drafts_in_one_pass = True  # one block forward per proposal, however many of its tokens are asked for

    def __init__(self, model: DFlashModel, params: SamplingParams) -> None:
        self.model, self.params, self.cfg = model, params, model.cfg
        self.name = "dspark" if model.cfg.dspark else "dflash"
        self.gives_confidence = bool(model.cfg.dspark)  # DSpark's confidence head; DFlash has none
        self.feature_layers = model.cfg.feature_layers
        self.device = model.norm.weight.device
        self._kv_n = 0  # committed positions whose context K/V is cached
        self._pending: list[torch.Tensor] = []  # features of the committed positions after those, not yet run
        self._pending_n = 0
        self._k: list[torch.Tensor] = []  # per layer [cap, K, hd]
        self._v: list[torch.Tensor] = []
        self.sampler = params.draft_sampler(self.device, stream="dflash")  # coupled when seeded
        self.released = False

    # ---- state -------------------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Committed positions the drafter holds features for (their context K/V is computed when next needed)."""
        return self._kv_n + self._pending_n

    def add_features(self, feats: torch.Tensor) -> None:
        """feats: [m, len(feature_layers) d], the next m committed positions' target features. Kept (`own`: not
        a view of a bigger step's buffer) and turned into context K/V at the next proposal or state check, in one
        batch: while the scheduler has speculation off, a step costs the drafter nothing."""
        assert not self.released, "the drafter was released"
        if feats.shape[0]:
            self._pending.append(own(feats, self.device))
            self._pending_n += feats.shape[0]

    @torch.inference_mode()
    def _catch_up(self) -> None:
        """Context K/V of the pending committed positions, in one batch."""
        if not self._pending:
            return
        feats = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        m, n0 = feats.shape[0], self._kv_n
        kv = self.model.context_kv(feats, torch.arange(n0, n0 + m, device=self.device))
        self._reserve(n0 + m, kv[0][0])
        for li, (k, v) in enumerate(kv):
            self._k[li][n0 : n0 + m] = k
            self._v[li][n0 : n0 + m] = v
        self._kv_n += m
        self._pending, self._pending_n = [], 0

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
        self._catch_up()
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

    def release(self, tokens: Sequence[int] | None = None) -> None:
        self._k, self._v, self._pending, self._pending_n = [], [], [], 0
        self.released = True

    # ---- drafting ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def block(self, anchor: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One block forward: anchor at position pos over the cached context -> h [B, d], U [B - 1, V]."""
        h = self.hidden(anchor, pos)
        return h, self.model.logits(h[1:])

    @torch.inference_mode()
    def hidden(self, anchor: int, pos: int) -> torch.Tensor:
        """The block forward without the logits: anchor at position pos over the cached context -> h [B, d]."""
        B = self.cfg.block_size
        self._catch_up()
        x = self.model.block_inputs(torch.tensor([anchor], device=self.device))[0]  # [B, d]
        positions = torch.arange(pos, pos + B, device=self.device)
        kernel = self.model.kernel
        if kernel is not None:  # the block's K/V go after the context rows, as scratch
            self._reserve(self.n + B, x.new_empty((1, self.cfg.num_kv_heads, self.cfg.head_dim)))
            return kernel.block_hidden(x, positions, self._k, self._v, self.n)
        ctx = [(k[: self.n], v[: self.n]) for k, v in zip(self._k, self._v)] if self.n else self._empty_ctx(x)
        return self.model.block_hidden(x, positions, ctx, None)  # [B, d]

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
        h = self.hidden(int(context[-1]), n)  # [B, d]
        p, vocab, markov = self.params, self.model.vocab, self.model.markov
        if p.greedy and self.model.selector is None:  # logits of the g rows asked for, of the draft tokens only
            hg = h[1 : g + 1]
            U = vocab.small_logits(hg) if vocab is not None else self.model.logits(hg)  # [g, Vd or V]
            if markov is None:
                toks = argmax_rows(U)
                return Draft(vocab.ids[toks].tolist() if vocab is not None else toks)
            # DSpark greedy: left to right, argmax(U_k + B_k)
            toks, conf = markov.greedy(U, hg, int(context[-1]), vocab)
            return Draft(toks, None, calibrated_confidence(conf, self.cfg.confidence_temperatures).tolist())
        U = self.model.logits(h[1:])  # [B - 1, V]
        if self.model.selector is not None:
            return self._select(U, h, int(context[-1]), g, n + 1)
        if markov is None:
            q = target_probs(U[:g], p.temperature, p.top_k, p.top_p)  # [g, V]
            return Draft(self.sampler.rows(q, n + 1), q)
        qs: list[torch.Tensor] = []

        def choose(z: torch.Tensor, j: int) -> torch.Tensor:  # z: [1, V] -> [1], block position j
            qs.append(target_probs(z, p.temperature, p.top_k, p.top_p)[0])
            return torch.tensor([self.sampler.index(qs[-1], n + 1 + j)], device=z.device)

        anchor = torch.tensor([int(context[-1])], device=self.device)
        toks, _, conf = self.model.markov.decode(U[None, :g], h[None, 1 : g + 1], anchor, choose)
        c = calibrated_confidence(conf[0], self.cfg.confidence_temperatures)  # [g]
        return Draft(toks[0].tolist(), torch.stack(qs) if qs else None, c.tolist())

    def _select(self, U: torch.Tensor, h: torch.Tensor, anchor: int, g: int, position: int) -> Draft:
        """DFlash 2: the path selector walks the block's top-m candidates (drafters/path_selector.py); sampled,
        each position's distribution over its candidates is returned scattered over the vocabulary. position: the
        first drafted token's absolute position."""
        sel, p, embed = self.model.selector, self.params, self.model.parts.rows
        lat = sel.lattice(U[:g], h[1 : g + 1], embed)
        tokens, dists = walk(lat, sel, embed, anchor, g, 0.0 if p.greedy else p.temperature, self.sampler, position)
        if p.greedy:
            return Draft(tokens)
        probs = torch.zeros(g, U.shape[-1], device=U.device)
        probs.scatter_(1, lat.cand, torch.stack(dists))
        return Draft(tokens, probs)

    @torch.inference_mode()
    def propose_tree(self, context: Sequence[int], budget: int, depth: int) -> TreeDraft:
        """The `budget` most probable draft paths of at most `depth` tokens as one tree (parents listed first).
        Best first: pop the most probable open node (ties: shallower, then older), keep it, open its TREE_TOPK
        children; a child is never more probable than its parent, so the kept nodes are ancestor-closed. Sampled
        requests (but through the path selector) draw each node's children without replacement from q, scored by
        rank (drafters/tree_growth.py says why), and the tree carries the distribution each was drawn from."""
        assert not self.released, "the drafter was released"
        n = len(context) - 1
        assert self.n == n, f"{self.name}: holds features for {self.n} positions, the context needs {n}"
        B = self.cfg.block_size
        depth = min(depth, budget, B - 1)
        if depth <= 0 or n + B > self.model.parts.max_positions:
            return TreeDraft((), ())
        h, U = self.block(int(context[-1]), n)  # [B, d], [B - 1, V]
        sel, embed, p = self.model.selector, self.model.parts.rows, self.params
        lat = sel.lattice(U[:depth], h[1 : depth + 1], embed) if sel is not None else None
        sampled = not p.greedy and lat is None
        plain = None if self.model.markov is not None or lat is not None else \
            torch.log_softmax(U[:depth].float(), -1).topk(TREE_TOPK)
        plain_q = target_probs(U[:depth], p.temperature, p.top_k, p.top_p) if sampled and plain else None  # [D, V]
        plain_cdf = None if plain_q is None else plain_q.double().cumsum(-1)  # [D, V]: every node of a depth draws
        tokens: list[int] = []
        parents: list[int] = []
        drawn: list[torch.Tensor] = []  # sampled: each kept node's q
        rows: dict[int, torch.Tensor] = {}  # sampled: each open node's q, by its order
        heap: list[tuple[float, int, int, int, int]] = []  # (-score, depth, order, parent node, token)
        order = 0

        def open_children(node: int, prev: int, d: int, score: float) -> None:  # d: the children's depth (1-based)
            nonlocal order
            if d > depth:
                return
            q = cdf = None
            if plain is not None:
                vals, idx = plain.values[d - 1], plain.indices[d - 1]
                q, cdf = (None, None) if plain_q is None else (plain_q[d - 1], plain_cdf[d - 1])
            elif lat is not None:  # the selector's step distribution over the m candidates given this node
                z = sel.next_logits(lat, d - 1, prev, embed)
                vals, j = torch.log_softmax(z, -1).topk(min(TREE_TOPK, z.shape[0]))
                vals, idx = vals + lat.mass[d - 1], lat.cand[d - 1, j]
            else:
                z = U[d - 1].float() + self.model.markov.bias(torch.tensor(prev, device=self.device)).float()
                vals, idx = torch.log_softmax(z, -1).topk(TREE_TOPK)
                q = target_probs(z[None], p.temperature, p.top_k, p.top_p)[0] if sampled else None
            toks, qs = (idx.tolist(), None) if q is None else \
                draw_children(q, TREE_TOPK, self.sampler, n + d, cdf)
            for j, (v, t) in enumerate(zip(vals.tolist(), toks)):
                heapq.heappush(heap, (-(score + v), d, order, node, t))
                if qs is not None:
                    rows[order] = qs[j]
                order += 1

        open_children(-1, int(context[-1]), 1, 0.0)
        while heap and len(tokens) < budget:
            neg, d, o, parent, tok = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            if sampled:
                drawn.append(rows.pop(o))
            open_children(len(tokens) - 1, tok, d + 1, -neg)
        return TreeDraft(tuple(tokens), tuple(parents), torch.stack(drawn) if drawn else None)
