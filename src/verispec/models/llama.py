"""One decoder implementation for the Llama family: Llama, SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k norm),
Mistral (sliding window); tied or untied embeddings. Config switches, no per-model copies.

The forward takes a flat block of new tokens that may belong to several sequences (segments), writes
their K/V into the cache at their positions, and attends per sequence with the right causal / window mask.
Linear layers run once over all N flattened tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.config import ModelConfig
from verispec.state.kv_cache import KVCache
from verispec.models.rope import apply_rope, rope_tables


@dataclass(frozen=True)
class Segment:
    """`length` new tokens of the sequence in cache slot `slot`, at positions start .. start+length-1."""

    slot: int
    start: int
    length: int


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [M, vocab] float32, one row per requested index
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer i -> [N, d] hidden entering layer i
    last_hidden: torch.Tensor | None = None  # [N, d] after the final norm, if asked for


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's arithmetic: normalise in fp32, round to the model dtype, then scale. On CPU these few small ops
    # are cheaper than F.rms_norm, whose generic kernel costs more than the whole formula for one token.
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
    """q: [K, M, hd]; k, v: [K, L, hd]; blocked: [M, L] True where a key is hidden. Returns [K, M, hd].

    On CUDA this is SDPA's fused kernel. On CPU an explicit softmax(q k^T / sqrt(hd)) v in the cache's dtype
    (fp32 on CPU, where bf16 batched matmuls are slow), far cheaper than SDPA's CPU fallback for short blocks.
    """
    if q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if blocked is None else ~blocked)
    scores = torch.bmm(q.to(k.dtype), k.transpose(1, 2)).mul_(q.shape[-1] ** -0.5)  # [K, M, L]
    if blocked is not None:
        scores.masked_fill_(blocked, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), v).to(q.dtype)


def pre_attention(
    x: torch.Tensor,
    norm_w: torch.Tensor,
    qkv_w: torch.Tensor,
    qkv_b: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    H: int,
    K: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [N, d] -> q [N, H, hd], k [N, K, hd] (normed where the model has q/k norm, rotated), v [N, K, hd]."""
    n = x.shape[0]
    qkv = F.linear(_rms_norm(x, norm_w, eps), qkv_w, qkv_b)  # [N, (H + 2K) hd]
    hd = qkv.shape[1] // (H + 2 * K)
    v = qkv[:, (H + K) * hd :].view(n, K, hd)
    if q_norm is None:  # rotate q and k together: [N, H + K, hd]
        qk = apply_rope(qkv[:, : (H + K) * hd].view(n, H + K, hd), cos, sin)
        return qk[:, :H], qk[:, H:], v
    q = _rms_norm(qkv[:, : H * hd].view(n, H, hd), q_norm, eps)
    k = _rms_norm(qkv[:, H * hd : (H + K) * hd].view(n, K, hd), k_norm, eps)  # type: ignore[arg-type]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def post_attention(
    x: torch.Tensor,
    attn: torch.Tensor,
    o_w: torch.Tensor,
    o_b: torch.Tensor | None,
    norm_w: torch.Tensor,
    gate_up_w: torch.Tensor,
    gate_up_b: torch.Tensor | None,
    down_w: torch.Tensor,
    down_b: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """x: [N, d] residual, attn: [N, H hd] -> the residual after the output projection and the SwiGLU MLP."""
    x = _residual_linear(x, attn, o_w, o_b)
    gate, up = F.linear(_rms_norm(x, norm_w, eps), gate_up_w, gate_up_b).chunk(2, dim=-1)  # [N, I] each
    return _residual_linear(x, F.silu(gate) * up, down_w, down_b)


def _residual_linear(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x + h W^T (+ b), in one addmm when there is no bias."""
    if b is None:
        return torch.addmm(x, h, w.t())
    return x + F.linear(h, w, b)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.qkv = nn.Parameter(torch.empty(q_out + 2 * kv_out, d))  # q, k, v fused
        self.qkv_bias = nn.Parameter(torch.zeros(q_out + 2 * kv_out)) if cfg.attention_bias else None
        self.o = nn.Parameter(torch.empty(d, q_out))
        self.o_bias = nn.Parameter(torch.zeros(d)) if cfg.o_bias else None
        self.q_norm = nn.Parameter(torch.ones(hd)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd)) if cfg.qk_norm else None
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, d))  # gate, up fused
        self.gate_up_bias = nn.Parameter(torch.zeros(2 * cfg.intermediate_size)) if cfg.mlp_bias else None
        self.down = nn.Parameter(torch.empty(d, cfg.intermediate_size))
        self.down_bias = nn.Parameter(torch.zeros(d)) if cfg.mlp_bias else None


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rope_len: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self._init_rope(rope_len or cfg.max_position_embeddings)
        self._windows = {cfg.layer_window(i) for i in range(cfg.num_layers)}  # None = full attention


    def _init_rope(self, max_len: int) -> None:
        cos, sin = rope_tables(self.cfg, max_len, device=self.embed.device if not self.embed.is_meta else "meta")
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_len, head_dim] fp32
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_cache(self, max_len: int, num_slots: int = 1) -> KVCache:
        c = self.cfg
        if max_len > self.rope_cos.shape[0]:
            raise ValueError(f"max_len {max_len} exceeds the model's positions ({self.rope_cos.shape[0]})")
        # CPU keeps K/V in fp32 whatever the weights' dtype: attention runs fastest there in fp32
        kv_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, num_slots, kv_dtype, self.device)

    def output_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        segments: Sequence[Segment],
        cache: KVCache,
        logits_indices: torch.Tensor | Sequence[int] | None = None,
        capture_layers: Sequence[int] = (),
        return_last_hidden: bool = False,
    ) -> ForwardOutput:
        """input_ids: [N] tokens of all segments, concatenated in segment order.

        Reserves each segment's block in `cache` (the caller commits or rolls back afterwards).
        logits_indices: rows of the flat block to compute logits for (default: the last token of each segment).
        """
        cfg = self.cfg
        n_total = input_ids.shape[0]
        assert sum(s.length for s in segments) == n_total, "segments must cover input_ids exactly"
        reserved: list[Segment] = []
        try:
            for s in segments:
                assert cache.length(s.slot) == s.start, f"slot {s.slot}: block starts at {s.start} but cache " \
                    f"length is {cache.length(s.slot)}"
                cache.reserve(s.slot, s.length)
                reserved.append(s)
        except BaseException:  # all or nothing: a failed call leaves no half-reserved block behind
            for s in reserved:
                cache.rollback(s.slot, s.start)
            raise

        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments]).to(self.device)
        cos = self.rope_cos[positions].to(self.dtype).unsqueeze(1)  # [N, 1, head_dim]
        sin = self.rope_sin[positions].to(self.dtype).unsqueeze(1)
        masks = [self._masks(s) for s in segments]

        H, K = cfg.num_heads, cfg.num_kv_heads
        x = F.embedding(input_ids, self.embed)  # [N, d]
        hidden: dict[int, torch.Tensor] = {}
        eps = cfg.rms_norm_eps
        pre, post = pre_attention, post_attention
        for li, layer in enumerate(self.layers):
            if li in capture_layers:
                hidden[li] = x
            q, k, v = pre(x, layer.attn_norm, layer.qkv, layer.qkv_bias, layer.q_norm, layer.k_norm, cos, sin, H, K, eps)
            attn = self._attend(li, q, k, v, segments, masks, cache)  # [N, H hd]
            x = post(x, attn, layer.o, layer.o_bias, layer.mlp_norm, layer.gate_up, layer.gate_up_bias, layer.down,
                     layer.down_bias, eps)
        if cfg.num_layers in capture_layers:
            hidden[cfg.num_layers] = x

        if logits_indices is None:
            ends = torch.tensor([s.length for s in segments]).cumsum(0) - 1
            logits_indices = ends.to(self.device)
        elif not isinstance(logits_indices, torch.Tensor):
            logits_indices = torch.tensor(list(logits_indices), dtype=torch.long, device=self.device)
        if return_last_hidden:
            last = _rms_norm(x, self.norm, cfg.rms_norm_eps)
            sel = last[logits_indices]
        else:
            last = None
            sel = _rms_norm(x[logits_indices], self.norm, cfg.rms_norm_eps)
        logits = F.linear(sel, self.output_weight()).float()  # [M, vocab]
        return ForwardOutput(logits=logits, hidden=hidden, last_hidden=last)

    # ------------------------------------------------------------------------------------------
    def _masks(self, s: Segment) -> dict[int | None, tuple[int, torch.Tensor | None]]:
        """Per window size (None = full): (first key position read, bool [length, keys] True = hidden, or None)."""
        out: dict[int | None, tuple[int, torch.Tensor | None]] = {}
        end = s.start + s.length
        q_pos = torch.arange(s.start, end, device=self.device).unsqueeze(1)  # [n, 1]
        for w in self._windows:
            lo = 0 if w is None else max(0, s.start - w + 1)
            if s.length == 1:
                out[w] = (lo, None)  # one query sees every key in [lo, end)
                continue
            k_pos = torch.arange(lo, end, device=self.device).unsqueeze(0)  # [1, keys]
            blocked = k_pos > q_pos
            if w is not None:
                blocked |= k_pos <= q_pos - w
            out[w] = (lo, blocked)
        return out

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: Sequence[Segment],
        masks: list[dict[int | None, tuple[int, torch.Tensor | None]]],
        cache: KVCache,
    ) -> torch.Tensor:
        """q: [N, H, hd]; k, v: [N, K, hd]. Writes k, v to the cache; returns [N, H hd]."""
        cfg = self.cfg
        H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        G = H // K
        window = cfg.layer_window(layer)
        outs = []
        off = 0
        for s, m in zip(segments, masks):
            n, end = s.length, s.start + s.length
            cache.write(layer, s.slot, s.start, k[off : off + n].transpose(0, 1), v[off : off + n].transpose(0, 1))
            lo, blocked = m[window]
            keys = cache.k[layer][s.slot, :, lo:end]  # [K, L, hd]
            vals = cache.v[layer][s.slot, :, lo:end]
            # group the G query heads that share one KV head: [n, H, hd] -> [K, G n, hd]
            qs = q[off : off + n].transpose(0, 1).reshape(K, G * n, hd)
            if blocked is not None:
                blocked = blocked.repeat(G, 1)  # [G n, L], rows in the same (g, i) order as qs
            o = _attention(qs, keys, vals, blocked)  # [K, G n, hd]
            outs.append(o.reshape(H, n, hd).transpose(0, 1).reshape(n, H * hd))
            off += n
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


# ---- weights --------------------------------------------------------------------------------------
def load_hf_state_dict(model: LlamaModel, sd: Mapping[str, torch.Tensor]) -> None:
    """Copy weights named as in HF transformers' LlamaForCausalLM / Qwen2 / Qwen3 / Mistral into `model`."""
    cfg = model.cfg
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        for key in (name, name.removeprefix("model."), "model." + name):
            if key in sd:
                used.add(key)
                return sd[key]
        raise KeyError(f"checkpoint has no tensor {name!r}")

    def put(param: torch.Tensor | None, value: torch.Tensor) -> None:
        assert param is not None
        if param.shape != value.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(value.shape)} vs model {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value)

    put(model.embed, get("model.embed_tokens.weight"))
    put(model.norm, get("model.norm.weight"))
    if model.lm_head is not None:
        put(model.lm_head, get("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        put(layer.attn_norm, get(p + "input_layernorm.weight"))
        put(layer.mlp_norm, get(p + "post_attention_layernorm.weight"))
        put(layer.qkv, torch.cat([get(a + f"{n}_proj.weight") for n in "qkv"]))
        if layer.qkv_bias is not None:
            put(layer.qkv_bias, torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"]))
        put(layer.o, get(a + "o_proj.weight"))
        if layer.o_bias is not None:
            put(layer.o_bias, get(a + "o_proj.bias"))
        if layer.q_norm is not None:
            put(layer.q_norm, get(a + "q_norm.weight"))
            put(layer.k_norm, get(a + "k_norm.weight"))
        m = p + "mlp."
        put(layer.gate_up, torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]))
        if layer.gate_up_bias is not None:
            put(layer.gate_up_bias, torch.cat([get(m + "gate_proj.bias"), get(m + "up_proj.bias")]))
        put(layer.down, get(m + "down_proj.weight"))
        if layer.down_bias is not None:
            put(layer.down_bias, get(m + "down_proj.bias"))
    ignored = [k for k in sd if k not in used and "rotary_emb" not in k]
    if model.lm_head is None:
        ignored = [k for k in ignored if k != "lm_head.weight"]
    if ignored:
        raise ValueError(f"checkpoint tensors not used by the model (wrong architecture?): {ignored[:5]}")
