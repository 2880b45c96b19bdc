"""Native MTP heads: the target checkpoint's own multi-token-prediction layers as a drafter (`--method mtp`).

The layers are read from the target's directory in the layout it ships (models/mtp_layout.py: DeepSeek-V3, MiMo or
Qwen3-Next names, each with its own rule for combining the target's state with the next token's embedding). The
block is one of our decoder `Layer`s, run over a KV cache of its own through the same attention code as the target.

Pairing (as EAGLE's): the MTP row at position j reads (h_j, token x_{j+1}) and its logits draft x_{j+2}. Committed
rows are run once, when their pair token is known; drafting chains the MTP's own state: the draft of step s + 1
reads (state of step s, token drafted at step s) at the next position, in scratch rows rolled back afterwards.
A checkpoint with several MTP layers drafts with its first one at every step (vLLM's MiMo does the same); the others
are loaded and checked, not run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.drafters.base import Draft, drafted_confidence, greedy_pick
from verispec.sampling import SamplingParams, target_probs
from verispec.models.hf_weights import load_layer
from verispec.models.llama import Layer, LlamaModel, Segment, attention_context, rms_norm
from verispec.models.mtp_layout import MTPLayout, MTPLayoutError, block_intermediate, detect, problems
from verispec.state.kv_cache import KVCache


class MTPLayer(nn.Module):
    """One MTP layer: the two input norms, the projection of their concatenation, the block and the output norm
    (plus the layout's own LM head / embedding where it ships them)."""

    def __init__(self, block_cfg, index: int, own_head: bool, own_embed: bool, vocab: int) -> None:
        super().__init__()
        d = block_cfg.hidden_size
        self.emb_norm = nn.Parameter(torch.ones(d))
        self.hidden_norm = nn.Parameter(torch.ones(d))
        self.proj = nn.Parameter(torch.empty(d, 2 * d))
        self.out_norm = nn.Parameter(torch.ones(d))
        self.block = Layer(block_cfg, index)
        self.head = nn.Parameter(torch.empty(vocab, d)) if own_head else None
        self.embed = nn.Parameter(torch.empty(vocab, d)) if own_embed else None


class MTPHead(nn.Module):
    """The target's MTP layers and how to run them; shared by every request's `MTPDrafter`."""

    def __init__(self, layout: MTPLayout, block_cfg, target: LlamaModel, own: dict[str, bool]) -> None:
        super().__init__()
        self.layout, self.block_cfg = layout, block_cfg
        self.layers = nn.ModuleList(
            MTPLayer(block_cfg, i, own.get("own_head", False), own.get("own_embed", False), target.cfg.vocab_size)
            for i in range(block_cfg.num_layers))
        self._target = [target]  # the shared embedding, LM head, final norm and RoPE tables: not ours to save
        self.eps = block_cfg.rms_norm_eps

    @property
    def target(self) -> LlamaModel:
        return self._target[0]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (self._target[0].cfg.num_layers,)  # the last layer's output, before the target's final norm

    def new_cache(self, max_len: int, num_slots: int) -> KVCache:
        c, t = self.block_cfg, self._target[0]
        kv_dtype = torch.float32 if t.device.type == "cpu" else t.dtype
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, num_slots, kv_dtype, t.device)

    def hidden_in(self, feats: torch.Tensor) -> torch.Tensor:
        """[n, d] the target's last-layer output -> the state this layout feeds its MTP (after the final norm or
        not), computed as the target's own head computes it."""
        t = self._target[0]
        return rms_norm(feats, t.norm, t.cfg.rms_norm_eps) if self.layout.target_post_norm else feats

    def combine(self, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, i: int = 0) -> torch.Tensor:
        """emb, h: [n, d], positions: [n] -> the block's input [n, d] by the layout's rule."""
        layer = self.layers[i]
        if self.layout.mask_first_embedding:
            emb = emb.masked_fill((positions == 0)[:, None], 0.0)
        e, hh = rms_norm(emb, layer.emb_norm, self.eps), rms_norm(h, layer.hidden_norm, self.eps)
        return F.linear(torch.cat([e, hh] if self.layout.emb_first else [hh, e], -1), layer.proj)

    def embed(self, ids: torch.Tensor, i: int = 0) -> torch.Tensor:
        table = self.layers[i].embed
        return F.embedding(ids, self._target[0].embed if table is None else table)

    def run(self, x: torch.Tensor, cache: KVCache, seg: Segment, i: int = 0) -> torch.Tensor:
        """The block over x [n, d] at the segment's positions (its K/V written to `cache`) -> o [n, d]."""
        t = self._target[0]
        cache.reserve(seg.slot, seg.length)
        ctx = attention_context(self.block_cfg, [seg], cache, t.rope_rows([seg]))
        return self.layers[i].block(x, ctx)

    def outputs(self, o: torch.Tensor, i: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """o: [n, d] the block's output -> (the state chained to the next step [n, d], logits [n, V] float32)."""
        layer = self.layers[i]
        normed = rms_norm(o, layer.out_norm, self.eps)
        head = self._target[0].output_weight() if layer.head is None else layer.head
        return (normed if self.layout.norm_feeds_chain else o), F.linear(normed, head).float()


# ---- loading ---------------------------------------------------------------------------------------------------
def load(directory: str | Path, target: LlamaModel) -> MTPHead:
    """The MTP layers of the target checkpoint in `directory`, in the target's dtype and device; MTPLayoutError
    (a ValueError) naming what is absent, miscounted or not runnable."""
    from contextlib import ExitStack

    from safetensors import safe_open

    from verispec.models.loader import read_config, tensor_index

    d = Path(directory)
    cfg = read_config(d)
    index = tensor_index(d)
    names, shapes = set(index), {n: shape for n, (_, shape) in index.items()}
    layout, count = detect(cfg, names, where=str(d))
    L = int(cfg["num_hidden_layers"])
    bad = problems(layout, names, L, count) + _gated(layout, shapes, target, count, L)
    if bad:
        raise MTPLayoutError(f"{d}: " + "; ".join(bad))
    block_cfg = dataclasses.replace(target.cfg, num_layers=count, sliding_layers=(), sliding_window=None, mtp_layers=0,
                                    intermediate_size=block_intermediate(shapes, layout, 0, L))
    first = layout.names(0, L)
    own = {role: role in first and first[role] in names for role in ("own_head", "own_embed")}
    head = MTPHead(layout, block_cfg, target, own)
    with ExitStack() as stack:  # each file opened once, for all the tensors it holds
        files = {f: stack.enter_context(safe_open(str(f), "pt")) for f in {f for f, _ in index.values()}}

        def get(name: str) -> torch.Tensor:
            if name not in index:
                raise MTPLayoutError(f"the checkpoint has no tensor {name!r}")
            return files[index[name][0]].get_tensor(name)

        _fill(head, layout, L, get)
    return head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def _gated(layout: MTPLayout, shapes: dict[str, tuple[int, ...]], target: LlamaModel, count: int, L: int
           ) -> list[str]:
    """Qwen3-Next's gated attention: q_proj also yields the output gate (twice the query rows)."""
    c = target.cfg
    out = []
    for i in range(count):
        q = shapes.get(layout.block(i, L) + "self_attn.q_proj.weight")
        if q is not None and q[0] == 2 * c.num_heads * c.head_dim:
            out.append(f"MTP layer {i} is gated attention (q_proj yields queries and gates), which verispec's "
                       "Llama-family block does not run")
    return out


def _fill(head: MTPHead, layout: MTPLayout, L: int, get) -> None:
    """Copy each layer's tensors in; a zero-centred layout's RMSNorm scales become 1 + w."""
    shift = 1.0 if layout.zero_centred_norms else 0.0
    with torch.no_grad():
        for i, layer in enumerate(head.layers):
            names = layout.names(i, L)
            for role, param in (("emb_norm", layer.emb_norm), ("hidden_norm", layer.hidden_norm),
                                ("out_norm", layer.out_norm)):
                param.copy_(get(names[role]).float() + shift)
            layer.proj.copy_(get(names["proj"]))
            for role, param in (("own_head", layer.head), ("own_embed", layer.embed)):
                if param is not None:
                    param.copy_(get(names[role]))
            load_layer(layer.block, layout.block(i, L), get)
            if shift:
                for norm in (layer.block.attn_norm, layer.block.mlp_norm, layer.block.q_norm, layer.block.k_norm):
                    if norm is not None:
                        norm.add_(shift)


# ---- the per-request drafter -----------------------------------------------------------------------------------
class MTPDrafter:
    """Per request. State: the MTP K/V of every committed position whose pair token is known (rows 0 .. n_kv-1 in
    its cache slot), and the target states of the committed positions not yet run (`waiting`)."""

    name = "mtp"
    stops_early = True  # confidences: its probability of each drafted token (drafters/base.py drafted_confidence)

    def __init__(self, head: MTPHead, cache: KVCache, params: SamplingParams) -> None:
        self.head, self.cache, self.params = head, cache, params
        self.feature_layers = head.feature_layers
        self.slot = cache.allocate()
        t = head.target
        self.waiting = torch.empty(0, t.cfg.hidden_size, device=t.device, dtype=t.dtype)  # [n_feat - n_kv, d]
        self.n_feat = 0
        self.sampler = params.draft_sampler(t.device, stream="mtp")  # coupled when seeded

    @property
    def n_kv(self) -> int:
        return self.cache.length(self.slot)

    @torch.inference_mode()
    def add_features(self, feats: torch.Tensor) -> None:
        """[n, d] the target's last-layer outputs of the next committed positions."""
        self.waiting = torch.cat([self.waiting, self.head.hidden_in(feats.to(self.waiting.dtype))])
        self.n_feat += feats.shape[0]

    def _catch_up(self, context: Sequence[int]) -> torch.Tensor:
        """Run and commit rows n_kv .. n_feat-1 (pair tokens context[n_kv+1 .. n_feat]); their last output [1, d]."""
        j0, dev = self.n_kv, self.waiting.device
        m = self.n_feat - j0
        assert m > 0, "propose twice without new target features"
        pos = torch.arange(j0, j0 + m, device=dev)
        x = self.head.combine(self.head.embed(torch.tensor(list(context[j0 + 1 : j0 + 1 + m]), device=dev)),
                              self.waiting, pos)
        o = self.head.run(x, self.cache, Segment(self.slot, j0, m))
        self.cache.commit(self.slot, m)
        self.waiting = self.waiting[:0]
        return o[-1:]

    def _pick(self, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None, float]:
        """[V] -> (token, q or None when greedy, the token's confidence); position: the token's absolute position
        (a seeded request's coupled draw)."""
        if self.params.greedy:
            t, conf = greedy_pick(logits)
            return t, None, conf
        p = self.params
        q = target_probs(logits[None], p.temperature, p.top_k, p.top_p)[0]
        t = self.sampler.index(q, position)
        return t, q, drafted_confidence(logits, t, q)

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int, min_survival: float = 0.0) -> Draft:
        """Up to k tokens; fewer where the product of the confidences so far falls below min_survival."""
        assert self.n_feat == len(context) - 1, (
            f"MTP holds target states for {self.n_feat} positions but the context has {len(context)} tokens")
        k = min(k, self.cache.max_len - len(context))
        if k <= 0 or self.n_feat == 0:
            return Draft([])
        state, logits = self.head.outputs(self._catch_up(context))
        committed, tokens, probs, confs, survival = self.n_kv, [], [], [], 1.0
        try:
            for s in range(k):
                t, q, conf = self._pick(logits[0], len(context) + s)
                tokens.append(t)
                confs.append(conf)
                survival *= confs[-1]
                if q is not None:
                    probs.append(q)
                if s + 1 == k or survival < min_survival:
                    break
                pos = self.n_kv  # the next row: (this step's state, its drafted token), a scratch row
                x = self.head.combine(self.head.embed(torch.tensor([t], device=state.device)), state,
                                      torch.tensor([pos], device=state.device))
                o = self.head.run(x, self.cache, Segment(self.slot, pos, 1))
                self.cache.commit(self.slot, 1)
                state, logits = self.head.outputs(o)
        finally:
            self.cache.rollback(self.slot, committed)
        return Draft(tokens, torch.stack(probs) if probs else None, confs)

    def observe(self, accepted: int) -> None:
        """Nothing to undo: drafted rows were rolled back in propose; accepted ones return as target states."""

    @torch.inference_mode()
    def check_state(self, ref: torch.Tensor, tokens: Sequence[int]) -> None:
        """State oracle. ref: [n, d] the target's last-layer outputs of every committed position, from scratch."""
        n = len(tokens)
        if self.n_feat != n or ref.shape[0] != n:
            raise AssertionError(f"MTP holds target states for {self.n_feat} positions, the request commits {n}")
        atol, rtol = (1e-4, 1e-5) if self.waiting.dtype == torch.float32 else (1e-1, 2e-2)
        h = self.head.hidden_in(ref.to(self.waiting.dtype))
        m = self.n_kv
        if m >= n:
            raise AssertionError(f"MTP ran {m} rows, but only {n - 1} committed positions have a committed next token")
        if not torch.allclose(self.waiting, h[m:], atol=atol, rtol=rtol):
            raise AssertionError(f"MTP target states of positions {m}..{n - 1} differ from the target's")
        if m:
            fresh = self.head.new_cache(m, 1)
            slot = fresh.allocate()
            pos = torch.arange(m, device=h.device)
            x = self.head.combine(self.head.embed(torch.tensor(list(tokens[1 : m + 1]), device=h.device)), h[:m], pos)
            self.head.run(x, fresh, Segment(slot, 0, m))
            fresh.commit(slot, m)
            for name, live, want in (("K", self.cache.k[0][self.slot, :, :m], fresh.k[0][slot, :, :m]),
                                     ("V", self.cache.v[0][self.slot, :, :m], fresh.v[0][slot, :, :m])):
                bad = ((live - want).abs() > atol + rtol * want.abs()).any(-1).any(0).nonzero()  # positions
                if bad.numel():
                    raise AssertionError(f"MTP {name} of position {int(bad[0, 0])} of {m} differs from a "
                                         "recomputation from the committed tokens")

    def release(self, tokens: Sequence[int] | None = None) -> None:
        self.cache.free(self.slot)
