"""EAGLE-3's draft layer on verispec's CPU kernel, beside a gguf-q8act target: the head's step in eight kernel
calls instead of about forty torch ops (on a 135M target a draft token cost about 0.8 ms through torch, most of it
per-op overhead, against 4.4 ms for a whole target forward).

The same layer as drafters/eagle3.py (see its docstring), with the kernel's own arithmetic for the pieces:

  qkv  = Wqkv[:, :d] . RMSNorm_in(e)  +  Wqkv[:, d:] . RMSNorm_hidden(f)   two calls, each norm fused; the second
                                                                          adds the first as its residual
  q, k = RoPE(q, k) (in place);  K/V written at the rows given
  attn = softmax(q k^T / sqrt(hd) + mask) v                                vs_attention, one call for every head
  h    = f + o(attn);  h = h + down(swiglu(gate_up(RMSNorm_post(h))))     residuals and norm fused
  logits = lm_head(RMSNorm(h))                                             the draft vocabulary

The weights are the head's own rounded to GGUF blocks (`kind`: Q8_0, Q4_1 or Q4_0; q | k | v and gate | up
stacked along N, q | k | v split at d along K): so the numbers are near the torch path's but not its bits. Drafts
may change; the output cannot (the target verifies every token). K/V of a position depend on its own row only
(per-row norms and per-row int8 scales), so recomputing them with `qkv` gives the same bits: the state oracle
compares exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.kernels.cpu_kernels import load
from verispec.kernels.q8act import Q8ActWeight


class Eagle3Kernel:
    """Built from a float32 CPU head before its linears are rounded (`Eagle3Head.quantize_q8act`); it reads the
    head's rounded o_proj, down_proj and lm_head and its norms at call time."""

    def __init__(self, head: nn.Module, kind: str = "Q8_0") -> None:  # drafters/eagle3.py's Eagle3Head (no cycle)
        c = head.cfg
        d = c.hidden_size
        w = torch.cat([head.q_proj.weight, head.k_proj.weight, head.v_proj.weight])  # [(H + 2K) hd, 2d]
        self.qkv_emb = Q8ActWeight.from_float(w[:, :d].contiguous(), kind)
        self.qkv_feat = Q8ActWeight.from_float(w[:, d:].contiguous(), kind)
        self.gate_up = Q8ActWeight.from_float(torch.cat([head.gate_proj.weight, head.up_proj.weight]), kind)
        self.head, self.kind = head, kind
        self.lib = load()

    def qkv(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """emb, feat: [n, d] float32 -> [n, (H + 2K) hd]: q and k rotated at `positions`, then v."""
        h, c = self.head, self.head.cfg
        first = self.qkv_emb.matmul(emb, norm=h.input_layernorm, eps=c.rms_norm_eps)
        out = self.qkv_feat.matmul(feat, norm=h.hidden_norm, eps=c.rms_norm_eps, residual=first)
        self.lib.rope(out, c.num_heads + c.num_kv_heads, c.head_dim, *h.rope(positions))
        return out

    def kv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, (H + 2K) hd] -> views k, v [n, K, hd]."""
        c = self.head.cfg
        n, q = qkv.shape[0], c.num_heads * c.head_dim
        kv = c.num_kv_heads * c.head_dim
        return (qkv[:, q : q + kv].view(n, c.num_kv_heads, c.head_dim),
                qkv[:, q + kv :].view(n, c.num_kv_heads, c.head_dim))

    def run(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | slice,
            k_cache: torch.Tensor, v_cache: torch.Tensor, keys: int, blocked: torch.Tensor | None) -> torch.Tensor:
        """emb, feat: [n, d]; K/V go to `rows` of the caches ([max, K, hd]); each query attends to cache rows
        0 .. keys - 1 except its `blocked` ones ([n, keys] True = hidden; None: all). Returns h [n, d]."""
        h, c = self.head, self.head.cfg
        n, H, KH, hd = emb.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        G = H // KH
        feat = feat.contiguous()  # the qkv input and the residual
        qkv = self.qkv(emb, feat, positions)
        k, v = self.kv(qkv)
        k_cache[rows], v_cache[rows] = k, v
        q = qkv[:, : H * hd]
        # query heads grouped by their kv head: [KH, n G, hd], row r's G heads together
        q3 = q.view(KH, G, hd) if n == 1 else q.reshape(n, KH, G, hd).transpose(0, 1).reshape(KH, n * G, hd)
        bias = None
        if blocked is not None:  # [1, n G, keys]: each row's mask for each of its G heads
            bias = torch.zeros(blocked.shape).masked_fill_(blocked, float("-inf")).repeat_interleave(G, 0)[None]
        att = self.lib.attention(q3, k_cache[:keys].transpose(0, 1), v_cache[:keys].transpose(0, 1), bias)
        att = att.view(1, H * hd) if n == 1 else att.view(KH, n, G, hd).transpose(0, 1).reshape(n, H * hd)
        x = h.o_proj.matmul(att, residual=feat)
        mid = self.gate_up.matmul(x, norm=h.post_attention_layernorm, eps=c.rms_norm_eps)
        return h.down_proj.matmul(mid, swiglu=True, residual=x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, d] -> [n, Vd] float32 draft-vocabulary logits."""
        h = self.head
        return h.lm_head.matmul(hidden.contiguous(), norm=h.norm, eps=h.cfg.rms_norm_eps)
