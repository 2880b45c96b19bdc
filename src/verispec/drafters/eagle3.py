"""EAGLE-3 (Li et al. 2025): one decoder layer over fused low/mid/high target features, its own small LM head.

Pairing: the head's input at position j is (feature f_j of the target at j, embedding of token x_{j+1}); its
output there predicts x_{j+2}. Drafting continues on its own output: the pre-norm hidden state it produced at
position j becomes the feature of position j + 1 (the training-time-test unroll trains exactly this).

  feature  f = fc([h_low; h_mid; h_high])                     [n, d]   (fc: 3d -> d)
  input    u = [RMSNorm_in(embed(x)); RMSNorm_hidden(f)]       [n, 2d]  (Q, K and V read u)
  layer    h = f + o(attn(u));  h = h + mlp(RMSNorm_post(h))    [n, d]   (residual from the feature)
  logits   lm_head(RMSNorm(h)) over the draft vocabulary       [n, Vd]; target id = draft id + d2t[draft id]

The token embedding is the target's (frozen, never saved). Checkpoints are safetensors + config.json with the
weight names vLLM and SGLang load for `LlamaForCausalLMEagle3` (see drafters/eagle3_export.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from verispec.config import DEFAULT_DRAFT_QUANTIZATION
from verispec.drafters.base import Draft, drafted_confidence, greedy_pick
from verispec.execution.features import own
from verispec.drafters.tree_growth import Growth, frontier_width
from verispec.sampling import SamplingParams, target_probs
from verispec.models.llama import LlamaModel
from verispec.models.llama import rms_norm as rms
from verispec.models.rope import apply_rope
from verispec.models.tree import TreeDraft

if TYPE_CHECKING:
    from verispec.drafters.eagle3_kernel import Eagle3Kernel

ARCH = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    feature_layers: tuple[int, ...]  # target layers whose entering hidden states are fused (vLLM's aux layer ids)
    target_hidden_size: int
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    ttt_steps: int = 7  # training-time-test unroll used in training (recorded for the model card)

    @classmethod
    def for_target(cls, target: LlamaModel, feature_layers: Sequence[int], draft_vocab_size: int,
                   intermediate_size: int | None = None) -> "Eagle3Config":
        c = target.cfg
        return cls(hidden_size=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                   intermediate_size=intermediate_size or c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
                   vocab_size=c.vocab_size, draft_vocab_size=min(draft_vocab_size, c.vocab_size),
                   feature_layers=tuple(feature_layers), target_hidden_size=c.hidden_size, rope_theta=c.rope_theta,
                   max_position_embeddings=c.max_position_embeddings)


LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, target: LlamaModel) -> None:
        super().__init__()
        self.cfg = cfg
        d, H, K, hd, i = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        self.fc = nn.Linear(len(cfg.feature_layers) * cfg.target_hidden_size, d, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.hidden_norm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(2 * d, H * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, K * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, K * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, d, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # target = draft + d2t
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # target id in draft vocab
        # the target's frozen embedding and RoPE tables: shared, not parameters of the head
        self._target = [target]
        self.kernel: Eagle3Kernel | None = None  # inference beside a gguf-q8act target (`quantize_q8act`)
        if target.cfg.hidden_size != cfg.target_hidden_size or target.cfg.vocab_size != cfg.vocab_size:
            raise ValueError(
                f"this EAGLE-3 head was trained for a target with hidden size {cfg.target_hidden_size} and vocabulary "
                f"{cfg.vocab_size}, not {target.cfg.hidden_size} / {target.cfg.vocab_size}: use a head trained for "
                "this target (`verispec train eagle3`)")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.cfg.feature_layers

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its norms'; its linears may be GGUF blocks, `quantize_q8act`)."""
        return self.norm.dtype

    def quantize_q8act(self, kind: str = "Q8_0") -> None:
        """Inference on verispec's CPU kernel: every linear rounded to `kind` blocks (Q8_0, Q4_1 or Q4_0; gguf's
        quantizer), int8 activations per 32, as the gguf-q8act target runs. A draft token then reads about a
        quarter (Q8_0) or an eighth (4-bit) of the float32 weight bytes; drafts change a little, verification keeps
        the output exact. Not for training. Drafting then runs the layer in a few kernel calls per step
        (drafters/eagle3_kernel.py)."""
        from verispec.drafters.eagle3_kernel import Eagle3Kernel
        from verispec.kernels.q8act import round_linears

        assert self.dtype is torch.float32 and self.norm.device.type == "cpu", "the q8act kernel is CPU float32"
        kernel = Eagle3Kernel(self, kind)  # from the float weights: q | k | v and gate | up stacked
        round_linears(self, LINEARS, kind)
        self.kernel = kernel

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # the target's table is frozen: detached, so training the head sends no gradient into it. Through the
        # target's own lookup: a GGUF target's rows are dequantised as looked up (and kept for small lookups);
        # `target.embed` would build its dense [V, d] table (113 MB at 49k x 576 in float32) on first use
        return self._target[0].embed_tokens(ids).detach().to(self.dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._target[0]
        if int(positions.max()) >= t.max_positions:
            raise ValueError("position beyond the target's RoPE table")
        dt = self.dtype
        return t.rope_cos[positions].to(dt).unsqueeze(1), t.rope_sin[positions].to(dt).unsqueeze(1)  # [n, 1, hd]

    # ---- the layer, split so training (TTT) and inference share every op ------------------------------------
    def qkv(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """emb, feat: [n, d] -> q [n, H, hd], k [n, K, hd] (rotated at `positions`), v [n, K, hd]."""
        c = self.cfg
        u = torch.cat([rms(emb, self.input_layernorm, c.rms_norm_eps), rms(feat, self.hidden_norm, c.rms_norm_eps)], -1)
        n = u.shape[0]
        cos, sin = self.rope(positions)
        q = apply_rope(self.q_proj(u).view(n, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(self.k_proj(u).view(n, c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, self.v_proj(u).view(n, c.num_kv_heads, c.head_dim)

    def post(self, feat: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """feat: [n, d] residual, attn: [n, H hd] -> the layer's pre-norm output h [n, d]."""
        h = feat + self.o_proj(attn)
        m = rms(h, self.post_attention_layernorm, self.cfg.rms_norm_eps)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[n, d] -> [n, Vd] draft-vocabulary logits (float32)."""
        if self.kernel is not None:
            return self.kernel.logits(h)
        return self.lm_head(rms(h, self.norm, self.cfg.rms_norm_eps)).float()

    def to_target_ids(self, draft_ids: torch.Tensor | int) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[n, Vd] -> [n, V]: -inf outside the draft vocabulary (the distribution the head can sample from)."""
        out = draft_logits.new_full((draft_logits.shape[0], self.cfg.vocab_size), float("-inf"))
        idx = torch.arange(self.cfg.draft_vocab_size, device=draft_logits.device)
        out[:, self.to_target_ids(idx)] = draft_logits
        return out

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path, extra: dict | None = None) -> None:
        if not isinstance(self.lm_head, nn.Linear):
            raise ValueError(f"this head's linears were rounded to {self.lm_head.kind} blocks for inference; save "
                             f"the float head")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(sd, str(out / "model.safetensors"))
        cfg = {"architectures": ["VerispecEagle3Head"], **asdict(self.cfg), **(extra or {})}
        (out / "config.json").write_text(json.dumps(cfg, indent=1))


def load(path: str | Path, target: LlamaModel, inference: bool = True, kind: str | None = None) -> Eagle3Head:
    """A head saved by `save_pretrained` (verispec layout) for `target`, in the target's dtype and device; for
    inference beside a gguf-q8act target, on the same kernel with its linears in `kind` blocks (`quantize_q8act`;
    None: config.DEFAULT_DRAFT_QUANTIZATION, what the engine loads); `inference=False`: float, to train."""
    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{p} is not an EAGLE-3 checkpoint (config.json missing)")
    raw = json.loads((p / "config.json").read_text())
    if raw.get("architectures") != ["VerispecEagle3Head"]:
        raise ValueError(f"{p} holds {raw.get('architectures')}, not a verispec EAGLE-3 head; for a vLLM-layout "
                         f"export use the directory it was exported from")
    fields = set(Eagle3Config.__dataclass_fields__)
    cfg = Eagle3Config(**{k: (tuple(v) if k == "feature_layers" else v) for k, v in raw.items() if k in fields})
    head = Eagle3Head(cfg, target)
    head.load_state_dict(load_file(str(p / "model.safetensors")))
    head = head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    if inference and target.decoder_kernel is not None:  # the gguf-q8act target: the head on the same kernel
        head.quantize_q8act(kind or DEFAULT_DRAFT_QUANTIZATION.upper())
    return head


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
    """q: [n, H, hd]; k, v: [L, K, hd]; blocked: [n, L] True = hidden -> [n, H hd] (grouped-query attention)."""
    n, H, hd = q.shape
    G = H // k.shape[1]
    kk = k.repeat_interleave(G, dim=1).transpose(0, 1)  # [H, L, hd]
    vv = v.repeat_interleave(G, dim=1).transpose(0, 1)
    s = torch.matmul(q.transpose(0, 1).float(), kk.float().transpose(1, 2)) / math.sqrt(hd)  # [H, n, L]
    if blocked is not None:
        s = s.masked_fill(blocked, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), vv.float()).to(q.dtype).transpose(0, 1).reshape(n, H * hd)


class Eagle3Drafter:
    """Per request. State: the fused target features of every committed position, and the head's K/V for the
    positions whose pair token is known (all committed positions but the newest, which waits for its next token).

    Drafted positions' K/V live only in a scratch area past the committed length and are never committed: after
    verification the accepted tokens are re-run with the target's real features (EAGLE's standard)."""

    name = "eagle3"
    # each position's confidence is the head's probability of the token it drafted (greedy: its top-1 over the draft
    # vocabulary; sampled: q of the sampled token), EAGLE-2's acceptance proxy; with min_survival it stops drafting
    # where their product falls below it (drafting is one layer per token: tokens not drafted are not paid for)
    stops_early = True

    def __init__(self, head: Eagle3Head, params: SamplingParams, max_len: int) -> None:
        c = head.cfg
        self.head, self.params = head, params
        self.feature_layers = head.feature_layers
        dev, dt = head.norm.device, head.dtype
        self._fused = torch.empty(max_len + 1, c.hidden_size, device=dev, dtype=dt)  # [n_feat, d] used rows
        self._n_fused = 0  # rows of _fused holding fused features
        # raw target features not fused yet: fusing waits until a proposal needs them, so that a request whose
        # speculation the scheduler turned off pays one copy per step, not the fc layer (fused in one batch later)
        self._raw: list[torch.Tensor] = []
        self._n_raw = 0
        self.k = torch.empty(max_len + 1, c.num_kv_heads, c.head_dim, device=dev, dtype=dt)
        self.v = torch.empty_like(self.k)
        self.n_kv = 0  # head K/V written for positions 0 .. n_kv-1 (committed)
        self.sampler = params.draft_sampler(dev, stream="eagle3")  # coupled when seeded
        # draft id -> target id as a list: a greedy pick indexes it (a tensor index costs ~9 us per token)
        self._target_id = head.to_target_ids(torch.arange(c.draft_vocab_size, device=dev)).tolist()

    @property
    def n_feat(self) -> int:
        return self._n_fused + self._n_raw

    @property
    @torch.inference_mode()
    def feats(self) -> torch.Tensor:
        """[n_feat, d] the fused features of every committed position (pending raw ones fused now, in one call)."""
        if self._raw:
            raw = self._raw[0] if len(self._raw) == 1 else torch.cat(self._raw)
            n = self._n_fused
            self._fused[n : n + raw.shape[0]] = self.head.fc(raw)
            self._n_fused, self._raw, self._n_raw = n + raw.shape[0], [], 0
        return self._fused[: self._n_fused]

    def add_features(self, feats: torch.Tensor) -> None:  # no autograd here to switch off
        """[n, len(layers) d] target features of the next committed positions (fused when next needed)."""
        if self.n_feat + feats.shape[0] > self._fused.shape[0]:
            raise ValueError(f"EAGLE-3 features past its {self._fused.shape[0]} positions")
        self._raw.append(own(feats, self._fused.device, self._fused.dtype))
        self._n_raw += feats.shape[0]

    def _run(self, emb: torch.Tensor, feat: torch.Tensor, start: int) -> torch.Tensor:
        """Write K/V at start.. and attend to 0..start+n-1 (causal). Returns the pre-norm outputs [n, d]."""
        n = emb.shape[0]
        pos = torch.arange(start, start + n, device=emb.device)
        blocked = torch.arange(start + n, device=emb.device)[None, :] > pos[:, None] if n > 1 else None  # [n, L]
        if self.head.kernel is not None:
            return self.head.kernel.run(emb, feat, pos, slice(start, start + n), self.k, self.v, start + n, blocked)
        q, k, v = self.head.qkv(emb, feat, pos)
        self.k[start : start + n], self.v[start : start + n] = k, v
        return self.head.post(feat, attend(q, self.k[: start + n], self.v[: start + n], blocked))

    def _pick(self, draft_logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None, float]:
        """[Vd] -> (target token id, q over the target vocabulary or None when greedy, the token's confidence);
        position: the token's absolute position (a seeded request's coupled draw)."""
        if self.params.greedy:
            j, conf = greedy_pick(draft_logits)
            return self._target_id[j], None, conf
        p = self.params
        q = target_probs(self.head.full_logits(draft_logits[None]), p.temperature, p.top_k, p.top_p)[0]
        t = self.sampler.index(q, position)
        return t, q, drafted_confidence(draft_logits, t, q)

    def _catch_up(self, context: Sequence[int]) -> torch.Tensor:
        """Run the committed pairs (f_j, x_{j+1}) not yet run, j = n_kv .. n_feat-1; returns the head's output
        [1, d] at position n_feat - 1, whose logits draft the token after the context."""
        j0 = self.n_kv
        assert j0 < self.n_feat, "propose twice without new target features"
        toks = torch.tensor(list(context[j0 + 1 :]), device=self.feats.device)
        h = self._run(self.head.embed(toks), self.feats[j0:], j0)[-1:]
        self.n_kv = self.n_feat
        return h

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int, min_survival: float = 0.0) -> Draft:
        """Up to k tokens; fewer where the product of the confidences so far falls below min_survival (the token
        at which it does is the last one drafted)."""
        assert self.n_feat == len(context) - 1, (
            f"EAGLE-3 holds features for {self.n_feat} positions but the context has {len(context)} tokens")
        k = min(k, self.k.shape[0] - len(context))
        if k <= 0 or self.n_feat == 0:
            return Draft([])
        dev = self.feats.device
        h = self._catch_up(context)  # [1, d] at position n_feat - 1
        tokens, probs, confs, survival = [], [], [], 1.0
        pos = self.n_feat - 1
        for i in range(k):
            t, q, c = self._pick(self.head.logits(h)[0], len(context) + i)
            tokens.append(t)
            confs.append(c)
            survival *= c
            if q is not None:
                probs.append(q)
            if i + 1 == k or survival < min_survival:
                break
            pos += 1  # own output becomes the next feature; scratch K/V past the committed ones
            h = self._run(self.head.embed(torch.tensor([t], device=dev)), h, pos)
        return Draft(tokens, torch.stack(probs) if probs else None, confs)

    @torch.inference_mode()
    def propose_tree(self, context: Sequence[int], budget: int, depth: int, width: int | None = None
                     ) -> TreeDraft:
        """EAGLE-2's dynamic tree: expand the TREE_TOPK best children of the `width` most probable nodes of each
        depth (by cumulative draft log-probability; `width` None: frontier_width(budget)), then keep the `budget`
        most probable nodes of all expanded ones (ancestor-closed: a path's log-probability never grows). Nodes are
        run in one batch per depth; each attends to the committed K/V, its ancestors and itself, at position
        n_feat - 1 + its depth."""
        return self._grow(context, budget, depth, width).best(budget)

    def _grow(self, context: Sequence[int], budget: int, depth: int, width: int | None = None) -> Growth:
        """width: nodes expanded per depth (None: frontier_width(budget))."""
        assert self.n_feat == len(context) - 1, (
            f"EAGLE-3 holds features for {self.n_feat} positions but the context has {len(context)} tokens")
        width = frontier_width(budget) if width is None else width
        room = self.k.shape[0] - len(context)  # scratch K/V rows past the committed ones (one node per row)
        depth = min(depth, budget, room, 1 + room // max(1, width))
        if depth <= 0 or self.n_feat == 0:
            return Growth(self.n_kv, width, origin=len(context))
        h = self._catch_up(context)  # [1, d]
        tree = Growth(self.n_kv, width, origin=len(context))  # scratch rows start after the rows _catch_up committed
        self._expand(tree, [-1], self.head.logits(h))
        for _ in range(depth - 1):
            frontier = tree.frontier()
            h_parent = torch.cat([h if tree.parent[i] < 0 else tree.out[tree.parent[i]] for i in frontier])
            out = self._run_nodes(tree, frontier, h_parent)  # [w, d]
            for i, hi in zip(frontier, out):
                tree.out[i] = hi[None]
            self._expand(tree, frontier, self.head.logits(out))
        return tree

    def _expand(self, tree: Growth, parents: list[int], logits: torch.Tensor) -> None:
        """logits: [len(parents), Vd] the head's draft logits below each parent. Sampled requests draw the children
        from q as the chain's tokens are drawn (`_pick`)."""
        p = self.params
        q = None if p.greedy else target_probs(self.head.full_logits(logits), p.temperature, p.top_k, p.top_p)
        tree.expand(parents, torch.log_softmax(logits.float(), -1), self.head.to_target_ids, q, self.sampler)

    def _run_nodes(self, tree: Growth, nodes: list[int], h_parent: torch.Tensor) -> torch.Tensor:
        """Run tree nodes (all of one depth) as one batch: K/V to the scratch rows after the committed ones, in
        run order; queries see the committed rows, their ancestors' rows and their own."""
        dev = h_parent.device
        toks = torch.tensor([tree.token[i] for i in nodes], device=dev)
        pos = torch.tensor([self.n_kv - 1 + tree.depth[i] for i in nodes], device=dev)
        first = tree.next_row
        for i in nodes:
            tree.row[i] = tree.next_row
            tree.next_row += 1
        L = tree.next_row
        seen = [[tree.row[a] for a in tree.path(i)] for i in nodes]  # each node's scratch rows: its path's
        blocked = None  # a single chain of expanded nodes sees every scratch row: no mask at all
        if any(len(rows) < L - self.n_kv for rows in seen):
            blocked = torch.ones(len(nodes), L, dtype=torch.bool, device=dev)
            blocked[:, : self.n_kv] = False
            j = torch.tensor([j for j, rows in enumerate(seen) for _ in rows], device=dev)
            blocked[j, torch.tensor([r for rows in seen for r in rows], device=dev)] = False
        emb = self.head.embed(toks)
        if self.head.kernel is not None:
            return self.head.kernel.run(emb, h_parent, pos, slice(first, L), self.k, self.v, L, blocked)
        q, k, v = self.head.qkv(emb, h_parent, pos)
        self.k[first:L], self.v[first:L] = k, v
        return self.head.post(h_parent, attend(q, self.k[:L], self.v[:L], blocked))

    def observe(self, accepted: int) -> None:
        """Nothing to undo: drafted K/V sit past n_kv and are overwritten by the next real pairs."""

    @torch.inference_mode()
    def check_state(self, ref: torch.Tensor, tokens: Sequence[int]) -> None:
        """ref: [n, len(layers) d] features of every committed position, recomputed from scratch."""
        n = len(tokens)
        if self.n_feat != n or ref.shape[0] != n:
            raise AssertionError(f"EAGLE-3 holds features for {self.n_feat} positions, the request commits {n}")
        # relative as well as absolute: the fused features reach thousands (the target's massive activations), where
        # fp32 rounding alone differs by 1e-4 between a batched verify forward and the from-scratch one, and up to
        # 1.5e-4 was seen at values near 5 (a prompt row prefilled beside other requests' drafts); a stale or
        # misplaced position differs by far more
        atol, rtol = (1e-3, 1e-5) if self.feats.dtype == torch.float32 else (1e-1, 2e-2)

        def differs(live: torch.Tensor, want: torch.Tensor) -> torch.Tensor:  # [n, ...] -> row indices
            return ((live - want).abs() > atol + rtol * want.abs()).flatten(1).any(-1).nonzero()

        fused = self.head.fc(ref.to(self.feats.dtype))
        bad = differs(self.feats, fused)
        if bad.numel():
            p = int(bad[0, 0])
            raise AssertionError(f"EAGLE-3 feature of position {p} differs from the target's (max abs diff "
                                 f"{float((fused[p] - self.feats[p]).abs().max()):.3g})")
        if self.n_kv:
            m = self.n_kv
            pos = torch.arange(m, device=fused.device)
            emb = self.head.embed(torch.tensor(list(tokens[1 : m + 1]), device=fused.device))
            kernel = self.head.kernel
            # recomputed with the arithmetic the live K/V came from (the kernel's, beside a gguf-q8act target)
            k, v = kernel.kv(kernel.qkv(emb, fused[:m], pos)) if kernel else self.head.qkv(emb, fused[:m], pos)[1:]
            for name, live, want in (("K", self.k[:m], k), ("V", self.v[:m], v)):
                bad = differs(live, want)
                if bad.numel():
                    raise AssertionError(f"EAGLE-3 {name} of position {int(bad[0, 0])} of {m} differs from a "
                                         "recomputation from the committed tokens")

    def release(self, tokens: Sequence[int] | None = None) -> None:
        self._fused = self._fused[:0]
        self._n_fused, self._raw, self._n_raw = 0, [], 0
        self.k = self.v = self._fused
