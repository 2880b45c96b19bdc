"""DFlash / DSpark's draft layers on verispec's CPU kernel, beside a gguf-q8act target: a block forward in about ten
kernel and torch calls per layer instead of about forty torch ops, and the context K/V of newly committed positions
for every layer in two linears (on the 135M default target a DSpark block cost about 3 ms through torch, most of it
per-op overhead, against 3.7 ms for a whole plain target step).

The same layers as drafters/dflash_model.py (see its docstring), with the kernel's own arithmetic for the pieces:

  block, per layer:
    qkv    = Wq|k|v . RMSNorm_in(x)                              one call, the norm fused
    q, k   = RMSNorm_head(q), RMSNorm_head(k); RoPE in place      q_norm / k_norm over every head in one op
    K/V of the block written after the context rows of the drafter's buffers (scratch: never counted as context)
    attn   = softmax(q [K_ctx; K_blk]^T / sqrt(hd)) [V_ctx; V_blk]   vs_attention, no mask: the block sees all
    x      = x + o(attn);  x = x + down(swiglu(gate|up(RMSNorm_post(x))))   residuals, norm and SwiGLU fused
  context K/V of m committed positions, every layer at once:
    [k_1 | .. | k_L | v_1 | .. | v_L] = Wk|v (all layers) . RMSNorm_hidden(W_c f);  k_norm; RoPE on the keys

The weights are the drafter's own rounded to Q8_0 (q | k | v, gate | up and every layer's k | v stacked along N,
which rounds each row exactly as alone): the numbers are near the torch path's but not its bits. Drafts may change;
the output cannot (the target verifies every token). The context K/V of a position depends on its own row only
(per-row norms and per-row int8 scales), so recomputing it gives the same bits: the state oracle compares exactly.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.kernels.cpu_kernels import load
from verispec.kernels.q8act import Q8ActWeight


class DFlashKernel:
    """Built from a float32 CPU drafter before its linears are rounded (`DFlashModel.quantize_q8act`); it reads the
    drafter's rounded W_c, o_proj and down_proj and its norms at call time."""

    def __init__(self, model: nn.Module, kind: str = "Q8_0") -> None:  # dflash_model.py's DFlashModel (no cycle)
        c = model.cfg
        self.model, self.cfg, self.lib, self.kind = model, c, load(), kind
        self.qkv = [Q8ActWeight.from_float(torch.cat([la.q_proj.weight, la.k_proj.weight, la.v_proj.weight]), kind)
                    for la in model.layers]
        self.gate_up = [Q8ActWeight.from_float(torch.cat([la.gate_proj.weight, la.up_proj.weight]), kind)
                        for la in model.layers]
        self.ctx_kv = Q8ActWeight.from_float(torch.cat([la.k_proj.weight for la in model.layers]
                                                       + [la.v_proj.weight for la in model.layers]), kind)
        H, K = c.num_heads, c.num_kv_heads
        # per-head norm weights: [H + K, hd] per layer (q's H heads, then k's K), [L, K, hd] for the context keys
        self.qk_norm = [torch.cat([la.q_norm.weight.expand(H, -1), la.k_norm.weight.expand(K, -1)]).contiguous()
                        for la in model.layers]
        self.k_norm = torch.stack([la.k_norm.weight.expand(K, -1) for la in model.layers]).contiguous()

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """feats: [m, len(layers) d] target features at `positions` [m] -> per layer (k rotated, v): [m, K, hd]
        (views of one [m, 2 L K hd] buffer)."""
        m, c, mdl = feats.shape[0], self.cfg, self.model
        L, K, hd = c.num_layers, c.num_kv_heads, c.head_dim
        f = mdl.fc.matmul(feats.float().contiguous())  # [m, d] = W_c f
        kv = self.ctx_kv.matmul(f, norm=mdl.hidden_norm.weight, eps=c.rms_norm_eps)  # [m, 2 L K hd]
        keys = kv[:, : L * K * hd].view(m, L, K, hd)
        keys.copy_(F.rms_norm(keys, (hd,), eps=c.rms_norm_eps) * self.k_norm)
        cos, sin = mdl.rope(positions)
        self.lib.rope(kv, L * K, hd, cos, sin)
        vals = kv[:, L * K * hd :].view(m, L, K, hd)
        return [(keys[:, li], vals[:, li]) for li in range(L)]

    def block_hidden(self, x: torch.Tensor, positions: torch.Tensor, k_bufs: Sequence[torch.Tensor],
                     v_bufs: Sequence[torch.Tensor], n: int) -> torch.Tensor:
        """x: [N, d] block rows at `positions` [N]; k_bufs, v_bufs: per layer [cap, K, hd] (cap >= n + N) holding
        the context K/V in rows 0 .. n - 1; the block's own K/V go to rows n .. n + N - 1 (left there, never counted
        as context). Returns the final-normed block hidden states [N, d] float32."""
        c, mdl = self.cfg, self.model
        N, H, KH, hd = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        G, eps = H // KH, c.rms_norm_eps
        cos, sin = mdl.rope(positions)
        x = x.float().contiguous()
        for li, layer in enumerate(mdl.layers):
            qkv = self.qkv[li].matmul(x, norm=layer.input_layernorm.weight, eps=eps)  # [N, (H + 2 KH) hd]
            qk = qkv[:, : (H + KH) * hd].view(N, H + KH, hd)
            qk.copy_(F.rms_norm(qk, (hd,), eps=eps) * self.qk_norm[li])
            self.lib.rope(qkv, H + KH, hd, cos, sin)
            kb, vb = k_bufs[li], v_bufs[li]
            kb[n : n + N] = qkv[:, H * hd : (H + KH) * hd].view(N, KH, hd)
            vb[n : n + N] = qkv[:, (H + KH) * hd :].view(N, KH, hd)
            # query heads grouped by their kv head: [KH, N G, hd], row r's G heads together
            q3 = qkv[:, : H * hd].reshape(N, KH, G, hd).transpose(0, 1).reshape(KH, N * G, hd)
            att = self.lib.attention(q3, kb[: n + N].transpose(0, 1), vb[: n + N].transpose(0, 1), None)
            att = att.view(KH, N, G, hd).transpose(0, 1).reshape(N, H * hd)
            x = layer.o_proj.matmul(att, residual=x)
            mid = self.gate_up[li].matmul(x, norm=layer.post_attention_layernorm.weight, eps=eps)
            x = layer.down_proj.matmul(mid, swiglu=True, residual=x)
        return F.rms_norm(x, (c.hidden_size,), weight=mdl.norm.weight, eps=eps)
