"""One decoder implementation for the Llama family: Llama, SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k norm),
Mistral (sliding window); tied or untied embeddings. Config switches, no per-model copies.

The forward takes a flat block of new tokens that may belong to several sequences (segments), writes
their K/V into the cache at their positions, and attends per sequence with the right causal / window mask.
Linear layers run once over all N flattened tokens.

`LlamaModel.forward` reserves the segments' blocks in the cache, builds one `AttentionContext` (the RoPE rows
of the new positions, the segments, the attention plan per window size, the cache) and runs every
`Layer.forward(x, ctx)` with it. The plan (models/attention.py) batches the attention of many sequences into few
calls per layer. On CPU at one token per step a layer is ~60 small ops besides its 4 matmuls, each costing
microseconds of dispatch, so the layer code keeps that count low (in-place ops, no Python-number operands, one
dtype conversion of q per layer, views instead of copies) without changing the arithmetic; the linears and the
RMSNorm are models/linear.py's. A model with a `decoder_kernel` (the gguf-q8act path, models/decoder_kernel.py)
runs all its layers in one call of it instead, with the same arithmetic.
`LlamaModel.prefill` / `prefill_fresh` are the one "forward over tokens in an empty slot, then commit" helper.
Weights keep their fused names (`layer.qkv`, `layer.o`, `layer.gate_up`, `layer.attn_norm`, ...): the loader,
the drafters and models/hf_weights.py address them directly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.config import DEFAULT_BLOCK_SIZE, ModelConfig
from verispec.models.attention import (AttentionKernel, AttentionPlan, CacheShape, attend_group, plan_attention,
                                       scores_dtype)
from verispec.models.linear import fuses, norm_linear, residual_linear, rms_norm
from verispec.models.rope import apply_rope, rope_tables
from verispec.models.tree import depths
from verispec.state.kv_cache import KVCache
from verispec.state.paged_kv import PagedKVCache

Cache = KVCache | PagedKVCache  # the slot cache (drafters, the oracle's reference) or the engine's paged one


@dataclass(frozen=True)
class Segment:
    """`length` new tokens of the sequence in cache slot `slot`, at positions start .. start+length-1.

    With `tree` (models/tree.py: the parent of each of the length - 1 nodes below the block's first token), the
    block is a draft tree: its K/V still go to positions start .. start+length-1, in node order, but each row's
    RoPE position is start + its depth and it attends to the context, its ancestors and itself only."""

    slot: int
    start: int
    length: int
    tree: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        assert self.tree is None or len(self.tree) == self.length - 1, "a tree segment is its root and one row per node"


@dataclass(frozen=True)
class AttentionContext:
    """What every layer's attention reads in one forward; `LlamaModel.forward` builds it once and passes it on."""

    cos: torch.Tensor  # [N, 1, head_dim] RoPE cosines of the N new positions, in the model's dtype
    sin: torch.Tensor  # [N, 1, head_dim] signed sines (see models/rope.py), in the model's dtype
    segments: tuple[Segment, ...]  # the N rows, in segment order
    plans: dict[int | None, AttentionPlan]  # per window size (None = full attention): the attention's groups
    cache: Cache  # each layer writes its K/V here (its own `Layer.index`) and reads the keys back
    per_query: bool = False  # every query position attends alone-shaped (`LlamaModel.batch_invariant`)
    kv_rows: torch.Tensor | None = None  # [N K] cache rows of the new K/V when there are several segments
    kernel: AttentionKernel | None = None  # the CPU attention arithmetic (`LlamaModel.attention_kernel`)
    rope: RopeKernel | None = None  # in-place RoPE of q and k on CPU (`LlamaModel.rope_kernel`)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [M, vocab] float32, one row per requested index
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer i -> [N, d] hidden entering layer i
    last_hidden: torch.Tensor | None = None  # [N, d] after the final norm, if asked for
    # [N, k d]: the states of `packed_layers` side by side, when the forward captured them into one buffer (the
    # decoder kernel; `hidden`'s entries for those layers are views of it)
    packed: torch.Tensor | None = None
    packed_layers: tuple[int, ...] = ()


def _offsets(s: Segment) -> Sequence[int]:
    """Each row's RoPE position minus the segment's start: 0 .. length-1, or the depths of a tree."""
    return range(s.length) if s.tree is None else depths(s.tree)


# in-place RoPE of the first `heads` heads of each row: (x [N, W] fp32, heads, head_dim, cos, sin) -> None
RopeKernel = Callable[[torch.Tensor, int, int, torch.Tensor, torch.Tensor], None]

class DecoderKernelLike(Protocol):
    """Every decoder layer of a forward in one call (models/decoder_kernel.py's `DecoderKernel`)."""

    def covers(self, segments: Sequence[Segment], cache: Cache) -> bool: ...

    def run(self, x: torch.Tensor, segments: Sequence[Segment], cache: Cache, cos: torch.Tensor, sin: torch.Tensor,
            capture: Sequence[int] = ()) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]: ...



class Layer(nn.Module):
    """Decoder layer `index`: x + attention(attn_norm(x)), then + SwiGLU(mlp_norm(.)), on fused weights."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
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
        # plain attributes, not weights: the cache layer this one writes, its window, head counts
        self.index = index
        self.window = cfg.layer_window(index)  # None = full attention
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """x: [N, d] the residual entering the layer -> [N, d] the residual leaving it."""
        q, k, v = self.project_qkv(x, ctx.cos, ctx.sin, ctx.rope)  # [N, H, hd], [N, K, hd], [N, K, hd]
        x = residual_linear(x, self.attend(q, k, v, ctx), self.o, self.o_bias)  # [N, d]
        return self.feed_forward(x)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeKernel | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, d] -> q [N, H, hd], k [N, K, hd] (normed where the model has q/k norm, rotated), v [N, K, hd].
        `rope`: a kernel rotating q and k in place (fp32 CPU), instead of `apply_rope`'s three ops."""
        n, H, K, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        flat = norm_linear(x, self.attn_norm, self.eps, self.qkv, self.qkv_bias)  # [N, (H + 2K) hd]
        qkv = flat.view(n, H + 2 * K, hd)
        if self.q_norm is None and rope is not None and flat.dtype is torch.float32 and flat.is_contiguous():
            rope(flat, H + K, hd, cos, sin)  # q and k heads rotated in place
            return qkv[:, :H], qkv[:, H : H + K], qkv[:, H + K :]
        if self.q_norm is None:  # rotate q and k together: [N, H + K, hd]
            qk = apply_rope(qkv[:, : H + K], cos, sin)
            return qk[:, :H], qk[:, H:], qkv[:, H + K :]
        q = rms_norm(qkv[:, :H], self.q_norm, self.eps)
        k = rms_norm(qkv[:, H : H + K], self.k_norm, self.eps)  # type: ignore[arg-type]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), qkv[:, H + K :]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q: [N, H, hd]; k, v: [N, K, hd]. Writes k, v to the cache, then attends in the groups of the context's
        plan for this layer's window (models/attention.py); returns [N, H hd] in q's dtype."""
        self._write_kv(k, v, ctx)
        plan = ctx.plans[self.window]
        ck, cv = ctx.cache.k[self.index], ctx.cache.v[self.index]  # [slots, K, T, hd]
        qf = q.to(scores_dtype(ck.dtype, ck.device))  # [N, H, hd]: one conversion for every row
        if plan.order is not None:
            qf = qf.index_select(0, plan.order)  # the rows grouped
        if len(plan.groups) == 1:
            o = attend_group(qf, plan.groups[0], ck, cv, ctx.kernel)  # [N, H hd]
        else:
            o = torch.cat([attend_group(qf[g.rows], g, ck, cv, ctx.kernel) for g in plan.groups])
        if plan.restore is not None:
            o = o.index_select(0, plan.restore)  # back to the block's row order
        return o.to(q.dtype)

    def _write_kv(self, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> None:
        """k, v: [N, K, hd] -> the cache: the cache's own write for one segment, or one indexed copy for many
        (their blocks were opened by `LlamaModel._reserve`, which checks what `KVCache.write` checks)."""
        cache, li = ctx.cache, self.index
        if ctx.kv_rows is None:
            s = ctx.segments[0]
            cache.write(li, s.slot, s.start, k.transpose(0, 1), v.transpose(0, 1))
            return
        for layer, new in ((cache.k[li], k), (cache.v[li], v)):  # [slots, K, T, hd] <- [N, K, hd]
            layer.view(-1, self.head_dim).index_copy_(0, ctx.kv_rows, new.to(layer.dtype).reshape(-1, self.head_dim))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, d] residual after attention -> [N, d] after the SwiGLU MLP."""
        h = norm_linear(x, self.mlp_norm, self.eps, self.gate_up, self.gate_up_bias)  # [N, 2I]: gate | up
        if self.down_bias is None and fuses(self.down) and h.dtype is torch.float32 and x.dtype is torch.float32:
            return self.down.matmul(h, swiglu=True, residual=x)  # type: ignore[operator]
        gate, up = h.chunk(2, dim=-1)
        return residual_linear(x, F.silu(gate).mul_(up), self.down, self.down_bias)  # gate, up: [N, I] each


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rope_len: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        # a module looking up embedding rows in place of the dense `embed` (models/gguf_embedding.py), or None; with
        # it, `embed` (and an untied `lm_head`) may be left out and built on first access (`dense_on_demand`)
        self.embedding: nn.Module | None = None
        self.dense_on_demand: dict[str, Callable[[], torch.Tensor]] = {}
        # a kernel module computing the logits in place of the dense output weight (models/quantized.py), or None
        self.head_weight: nn.Module | None = None
        # the CPU attention arithmetic in place of torch's batched matmuls (models/quantized.py), or None; likewise
        # in-place RoPE
        self.attention_kernel: AttentionKernel | None = None
        self.rope_kernel: RopeKernel | None = None
        # all decoder layers of a forward in one call (models/decoder_kernel.py; models/quantized.py), or None:
        # `covers(segments, cache)` says whether it takes a forward, `run(x, segments, cache, cos, sin, capture)`
        self.decoder_kernel: DecoderKernelLike | None = None
        self.set_rope_length(rope_len or cfg.max_position_embeddings)
        # True: every query position attends with shapes of its own (models/attention.py, per-query path), so a
        # token's logits do not depend on the block it is verified in or on the other requests of the forward when
        # the linears are batch-invariant too
        self.batch_invariant = False
        self._rope_cast: tuple[torch.Tensor, torch.Tensor] | None = None  # the RoPE tables in the model's dtype
        # the K/V caches' dtype (`LLM(kv_cache_dtype=...)`); None: float32 on CPU, the model's dtype elsewhere
        self.kv_cache_dtype: torch.dtype | None = None

    def set_rope_length(self, n: int) -> None:
        """(Re)build the RoPE tables for positions 0 .. n-1, in fp32 on the embedding's device (or meta)."""
        if self.norm.is_meta:  # shapes only: math on meta tensors would import torch._dynamo (~2 s) for nothing
            cos = sin = torch.empty(n, self.cfg.head_dim, device="meta")
        else:
            cos, sin = rope_tables(self.cfg, n, device=self.norm.device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [n, head_dim]
        self.register_buffer("rope_sin", sin, persistent=False)
        self._rope_cast = None

    @property
    def max_positions(self) -> int:
        """How many positions the RoPE tables cover: no sequence (and no cache) may be longer."""
        return self.rope_cos.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype  # the weights' dtype (the final norm's, present whatever holds the embedding)

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def __getattr__(self, name: str):
        """nn.Module's lookup, plus `embed` / `lm_head` built on first access where the loader left them out
        (`dense_on_demand`: the gguf-q8act path's light load, models/gguf_direct.py), for the drafters that read
        the target's tables as tensors; kept as parameters from then on."""
        if name in ("embed", "lm_head"):
            build = self.__dict__.get("dense_on_demand", {}).pop(name, None)
            if build is not None:
                with torch.inference_mode(False):
                    self.register_parameter(name, nn.Parameter(build(), requires_grad=False))
        return super().__getattr__(name)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The K/V caches' dtype: `kv_cache_dtype` where set, else float32 on CPU whatever the weights' dtype
        (attention runs fastest there in fp32; a float16 cache is read into fp32), the model's dtype elsewhere."""
        if self.kv_cache_dtype is not None:
            return self.kv_cache_dtype
        return torch.float32 if self.device.type == "cpu" else self.dtype

    def new_cache(self, max_len: int, num_slots: int = 1) -> KVCache:
        c = self.cfg
        if max_len > self.max_positions:
            raise ValueError(f"max_len {max_len} exceeds the model's positions ({self.max_positions})")
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, num_slots, self.kv_dtype, self.device)

    def new_paged_cache(self, max_len: int, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, num_slots: int = 1,
                        prefix_caching: bool = False) -> PagedKVCache:
        """The engine's cache: `num_blocks` blocks of `block_size` positions shared by up to `num_slots`
        sequences of at most `max_len` positions (state/paged_kv.py)."""
        c = self.cfg
        if max_len > self.max_positions:
            raise ValueError(f"max_len {max_len} exceeds the model's positions ({self.max_positions})")
        return PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, num_blocks, block_size, num_slots,
                            prefix_caching, self.kv_dtype, self.device)

    def output_weight(self) -> torch.Tensor:
        return self.embed if self.cfg.tie_word_embeddings else self.lm_head

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[N] ids -> [N, d] rows of the embedding (its lookup module's where it has one)."""
        return F.embedding(input_ids, self.embed) if self.embedding is None else self.embedding(input_ids)

    # ------------------------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor | Sequence[int], cache: Cache, slot: int,
                logits_indices: torch.Tensor | Sequence[int] | None = None, capture_layers: Sequence[int] = (),
                return_last_hidden: bool = False) -> ForwardOutput:
        """Forward `tokens` ([n] ids) as the first block of the empty `slot`, then commit all n positions."""
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), device=self.device)
        n = ids.shape[0]
        out = self(ids, [Segment(slot, 0, n)], cache, logits_indices=logits_indices, capture_layers=capture_layers,
                   return_last_hidden=return_last_hidden)
        cache.commit(slot, n)
        return out

    def prefill_fresh(self, tokens: torch.Tensor | Sequence[int], max_len: int | None = None,
                      logits_indices: torch.Tensor | Sequence[int] | None = None, capture_layers: Sequence[int] = (),
                      return_last_hidden: bool = False) -> tuple[KVCache, int, ForwardOutput]:
        """A one-slot cache of `max_len` positions (default: just the tokens), prefilled with `tokens` and
        committed: (cache, slot, the forward's output). The from-scratch reference the oracles compare with."""
        cache = self.new_cache(len(tokens) if max_len is None else max_len)
        slot = cache.allocate()
        out = self.prefill(tokens, cache, slot, logits_indices, capture_layers, return_last_hidden)
        return cache, slot, out

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        segments: Sequence[Segment],
        cache: Cache,
        logits_indices: torch.Tensor | Sequence[int] | None = None,
        capture_layers: Sequence[int] = (),
        return_last_hidden: bool = False,
    ) -> ForwardOutput:
        """input_ids: [N] tokens of all segments, concatenated in segment order.

        Reserves each segment's block in `cache` (the caller commits or rolls back afterwards).
        logits_indices: rows of the flat block to compute logits for (default: the last token of each segment).
        capture_layers: layer indices i whose entering hidden state [N, d] to return (i = num_layers: the last
        layer's output before the final norm). return_last_hidden: also return all N rows after the final norm.
        """
        assert sum(s.length for s in segments) == input_ids.shape[0], "segments must cover input_ids exactly"
        self._reserve(segments, cache)
        x = self.embed_tokens(input_ids)  # [N, d]
        kernel = self.decoder_kernel
        if kernel is not None and kernel.covers(segments, cache):  # every layer in one kernel call, x in place
            hidden, packed = kernel.run(x, segments, cache, *self.rope_rows(segments), capture_layers)
        else:
            (x, hidden), packed = self._layers(x, segments, cache, capture_layers), None
        packed_layers = tuple(sorted(hidden)) if packed is not None else ()  # before x (not in the buffer) joins
        if self.cfg.num_layers in capture_layers:
            hidden[self.cfg.num_layers] = x
        logits, last = self._head(x, segments, logits_indices, return_last_hidden)
        return ForwardOutput(logits=logits, hidden=hidden, last_hidden=last, packed=packed,
                             packed_layers=packed_layers)

    def _layers(self, x: torch.Tensor, segments: Sequence[Segment], cache: Cache, capture_layers: Sequence[int]
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x: [N, d] through every layer, one `Layer.forward` each -> ([N, d], {i: [N, d] entering layer i})."""
        ctx = self._context(segments, cache)
        hidden: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(self.layers):
            if li in capture_layers:
                hidden[li] = x
            x = layer(x, ctx)  # [N, d]
        return x, hidden

    # ------------------------------------------------------------------------------------------
    def _reserve(self, segments: Sequence[Segment], cache: Cache) -> None:
        """Open each segment's block in the cache; all or nothing, so a failed call leaves no half-reserved block."""
        reserved: list[Segment] = []
        try:
            for s in segments:
                assert cache.length(s.slot) == s.start, f"slot {s.slot}: block starts at {s.start} but cache " \
                    f"length is {cache.length(s.slot)}"
                cache.reserve(s.slot, s.length)
                reserved.append(s)
        except BaseException:
            for s in reserved:
                cache.rollback(s.slot, s.start)
            raise

    def _context(self, segments: Sequence[Segment], cache: Cache) -> AttentionContext:
        # an attention kernel computes each row alone (its result does not depend on masked keys padding the
        # range), so blocked plans keep the forward batch-invariant; torch's batched matmuls need per-query plans
        per_query = self.batch_invariant and self.attention_kernel is None
        return attention_context(self.cfg, segments, cache, self.rope_rows(segments), per_query,
                                 self.attention_kernel, self.rope_kernel)

    def rope_rows(self, segments: Sequence[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin: [N, 1, head_dim] in the model's dtype for the segments' positions (a view of the
        tables for one segment)."""
        cos, sin = self._rope_tables()
        if len(segments) == 1 and segments[0].tree is None:
            s = segments[0]
            return cos[s.start : s.start + s.length].unsqueeze(1), sin[s.start : s.start + s.length].unsqueeze(1)
        positions = torch.tensor([s.start + d for s in segments for d in _offsets(s)], device=self.device)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [N, 1, head_dim]

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 RoPE tables rounded to the model's dtype once (elementwise, so rows are as if rounded per use),
        redone when the model's dtype or device changed."""
        cast = self._rope_cast
        if cast is None or cast[0].dtype != self.dtype or cast[0].device != self.rope_cos.device:
            cast = self._rope_cast = (self.rope_cos.to(self.dtype), self.rope_sin.to(self.dtype))
        return cast

    def _head(self, x: torch.Tensor, segments: Sequence[Segment], logits_indices: torch.Tensor | Sequence[int] | None,
              return_last_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [N, d] -> (logits [M, vocab] float32 of the requested rows, [N, d] after the final norm or None). The
        logits take one arithmetic whether or not the hidden states are asked for: the final norm of the selected
        rows and the head in one `norm_linear` (one call where the head is a kernel that takes the norm)."""
        eps = self.cfg.rms_norm_eps
        head = self.output_weight() if self.head_weight is None else self.head_weight
        logits = norm_linear(_rows(x, segments, logits_indices), self.norm, eps, head, None).float()  # [M, vocab]
        return logits, rms_norm(x, self.norm, eps) if return_last_hidden else None


def _rows(x: torch.Tensor, segments: Sequence[Segment], indices: torch.Tensor | Sequence[int] | None) -> torch.Tensor:
    """The rows of x [N, d] that logits are asked for: `indices`, or the last row of each segment; a view where they
    are one run of rows (a decode step, a verify block)."""
    if indices is None:
        if len(segments) == 1:
            return x[-1:]
        indices = torch.tensor([s.length for s in segments]).cumsum(0) - 1
    elif isinstance(indices, range) and indices.step == 1 and 0 <= indices.start <= indices.stop <= len(x):
        return x[indices.start : indices.stop]
    elif not isinstance(indices, torch.Tensor):
        indices = torch.tensor(list(indices), dtype=torch.long)
    return x[indices.to(x.device)]


def attention_context(cfg: ModelConfig, segments: Sequence[Segment], cache: Cache,
                      rope: tuple[torch.Tensor, torch.Tensor], batch_invariant: bool = False,
                      kernel: AttentionKernel | None = None, rope_kernel: RopeKernel | None = None
                      ) -> AttentionContext:
    """What the layers of `cfg` read in one forward over `segments`: the RoPE rows (cos, sin [N, 1, hd]), the
    attention plan per window size (over the block tables of a paged cache) and the cache. The target's forward
    and a drafter running decoder layers of its own (drafters/mtp.py) build it alike. `kernel`, `rope_kernel`: the
    CPU attention and in-place RoPE arithmetic the layers use instead of torch's (None: torch's)."""
    cos, sin = rope
    paged = isinstance(cache, PagedKVCache)
    shape = CacheShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cache.span,
                       scores_dtype(cache.k[0].dtype, cos.device), cos.device,
                       cache.block_size if paged else None)  # type: ignore[union-attr]
    tables = {s.slot: cache.table(s.slot) for s in segments} if paged else None  # type: ignore[union-attr]
    plans = {w: plan_attention(segments, w, batch_invariant, shape, tables) for w in _windows(cfg)}
    rows = None if len(segments) == 1 else cache.kv_rows(segments, cos.device)
    return AttentionContext(cos, sin, tuple(segments), plans, cache, batch_invariant, rows, kernel, rope_kernel)


@functools.lru_cache(maxsize=64)
def _windows(cfg: ModelConfig) -> frozenset[int | None]:
    """The attention window sizes of `cfg`'s layers (None = full attention)."""
    return frozenset(cfg.layer_window(i) for i in range(cfg.num_layers))
