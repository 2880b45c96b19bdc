"""The DFlash block-diffusion draft model (docs/methods.md section 5), with DSpark's heads when cfg.dspark (section 6,
heads in dspark_head.py); the per-request drafter is in dflash.py.

Model. H_ctx = RMSNorm(W_c [f_{l1}; ...; f_{lm}]) projects the target's hidden states at the committed
positions (one feature row per position, `feature_layers` order). Each of `num_layers` decoder layers reads
  Q = proj(RMSNorm(x_block))                                     block positions only
  K, V = [proj(H_ctx) at context positions ; proj(RMSNorm(x_block)) at block positions]
with q/k norm and RoPE at the true positions, no causal mask: the block sees all context and itself. The block
is [anchor token embedding, mask embedding x (B - 1)] at positions p .. p+B-1 (p = the anchor's position); the
final-normed hidden state at block position k gives the logits of the token at p + k through the target's output
matrix. The target's embedding and output matrix are read, frozen, never trained nor saved.
  Deviation from the reference: the mask token is a learned vector (`mask_embedding`, [d]) instead of a new
  vocabulary entry, so the target's embedding table stays untouched.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.config import ModelConfig
from verispec.drafters.dspark_head import MarkovHead
from verispec.execution.features import dflash_target_layer_ids
from verispec.models.rope import apply_rope

MASK_HANDLING = "learned_embedding"
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]  # target layers whose OUTPUT is read (DFlash's convention)
    rms_norm_eps: float = 1e-6
    num_layers: int = 3
    block_size: int = 8  # B: the anchor plus B - 1 predicted positions
    mask: str = MASK_HANDLING
    dspark: bool = False
    markov_rank: int = 256
    confidence_temperatures: tuple[float, ...] = ()  # [B - 1] T_k from calibration; () = all 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        object.__setattr__(self, "confidence_temperatures", tuple(float(t) for t in self.confidence_temperatures))
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one draft position), got {self.block_size}")
        if self.num_layers < 1 or not self.target_layer_ids:
            raise ValueError("DFlash needs at least one draft layer and one target layer id")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.mask != MASK_HANDLING:
            raise ValueError(f"mask handling {self.mask!r} is not implemented; only {MASK_HANDLING!r}")
        temps = self.confidence_temperatures
        if temps and (len(temps) != self.block_size - 1 or min(temps) <= 0):
            raise ValueError(f"confidence_temperatures must be {self.block_size - 1} positive numbers, got {temps}")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The output of target layer i is the hidden state ENTERING layer i + 1."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @classmethod
    def for_target(cls, t: ModelConfig, num_layers: int = 3, block_size: int = 8, **kw) -> "DFlashConfig":
        """Draft layers shaped like the target's; target layers spread over [1, L-3] unless given."""
        ids = kw.pop("target_layer_ids", None) or dflash_target_layer_ids(t.num_layers, num_layers)
        return cls(hidden_size=t.hidden_size, vocab_size=t.vocab_size, num_heads=t.num_heads,
                   num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, intermediate_size=t.intermediate_size,
                   target_layer_ids=ids, rms_norm_eps=t.rms_norm_eps, num_layers=num_layers,
                   block_size=block_size, **kw)


@dataclass(frozen=True)
class TargetParts:
    """What the drafter reads from the target (frozen, shared, never saved). Drafting reads embedding rows through
    the target's own lookup (`rows`, `out_rows`): beside a GGUF target they are dequantised as looked up, and its
    table is never made dense for drafting (49,152 x 576 float32, 113 MB, on the default model; 0.9 GB at
    Qwen2.5-1.5B's shape). The dense tables (`embed`, `out_weight`) are built on first access and kept, for
    training, exports and a full-vocabulary head off the q8act kernel."""

    target: nn.Module  # models/llama.py's LlamaModel (an attribute of this dataclass, not a submodule of the drafter)
    dtype: torch.dtype
    rope_cos: torch.Tensor  # [max_len, head_dim] float32
    rope_sin: torch.Tensor  # [max_len, head_dim] float32 (signed, see models/rope.py)
    out_head: nn.Module | None = None  # the target's own output head on the q8act kernel (`quantize_q8act`)

    @classmethod
    def of(cls, target, dtype: torch.dtype | None = None) -> "TargetParts":
        return cls(target, dtype or target.dtype, target.rope_cos, target.rope_sin)

    @cached_property
    def embed(self) -> torch.Tensor:
        """[V, d] the dense embedding in `dtype`."""
        return self.target.embed.detach().to(self.dtype)

    @cached_property
    def out_weight(self) -> torch.Tensor:
        """[V, d] the dense output matrix in `dtype`."""
        return self.target.output_weight().detach().to(self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., d] embedding rows in `dtype`, through the target's lookup."""
        return self.target.embed_tokens(ids).detach().to(self.dtype)

    def out_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> [n, d] rows of the output matrix: the embedding's through the lookup where the head is tied."""
        return self.rows(ids) if self.target.cfg.tie_word_embeddings else self.out_weight[ids]

    @property
    def vocab_size(self) -> int:
        return self.target.cfg.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.target.cfg.hidden_size

    @property
    def max_positions(self) -> int:
        """How many positions the target's RoPE tables cover (the target's `LlamaModel.max_positions`)."""
        return self.rope_cos.shape[0]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.H, self.K, self.hd = c.num_heads, c.num_kv_heads, hd
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.q_proj = nn.Linear(d, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)

    def kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [n, d] (H_ctx rows or normed block rows); cos, sin: [n, 1, hd] -> k (rotated), v: [n, K, hd]."""
        n = h.shape[0]
        k = apply_rope(self.k_norm(self.k_proj(h).view(n, self.K, self.hd)), cos, sin)
        return k, self.v_proj(h).view(n, self.K, self.hd)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """x: [N, d] block rows; k_ctx, v_ctx: [C, K, hd]; allowed: [N, C + N] bool (None = all) -> [N, d]."""
        N = x.shape[0]
        h = self.input_layernorm(x)
        q = apply_rope(self.q_norm(self.q_proj(h).view(N, self.H, self.hd)), cos, sin)  # [N, H, hd]
        k_blk, v_blk = self.kv(h, cos, sin)
        G = self.H // self.K
        k = torch.cat([k_ctx, k_blk]).repeat_interleave(G, dim=1).transpose(0, 1)  # [H, C + N, hd]
        v = torch.cat([v_ctx, v_blk]).repeat_interleave(G, dim=1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=allowed)  # [H, N, hd]
        x = x + self.o_proj(o.transpose(0, 1).reshape(N, self.H * self.hd))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DFlashModel(nn.Module):
    def __init__(self, cfg: DFlashConfig, parts: TargetParts, init_mask: bool = True) -> None:
        """init_mask: start the mask embedding at the mean of the target's embedding rows (a new drafter; it reads
        the dense table); False: zeros, for weights about to be loaded."""
        super().__init__()
        d = cfg.hidden_size
        if (parts.vocab_size, parts.hidden_size) != (cfg.vocab_size, d) or parts.rope_cos.shape[-1] != cfg.head_dim:
            raise ValueError(f"target parts (embedding {(parts.vocab_size, parts.hidden_size)}, rope dim "
                             f"{parts.rope_cos.shape[-1]}) do not fit the drafter (V={cfg.vocab_size}, d={d}, "
                             f"head_dim={cfg.head_dim})")
        self.cfg = cfg
        self.parts = parts  # a plain attribute: not a parameter, not in the state dict
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)  # W_c
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(parts.embed.float().mean(0).to(parts.dtype).clone() if init_mask
                                           else torch.zeros(d, dtype=parts.dtype))  # [d]
        self.markov = MarkovHead(cfg.vocab_size, d, cfg.markov_rank) if cfg.dspark else None
        self.selector = None  # DFlash 2's path selector (drafters/path_selector.py), stored in files of its own
        self.kernel = None  # inference beside a gguf-q8act target (`quantize_q8act`, drafters/dflash_kernel.py)
        self.vocab = None  # inference with a draft vocabulary (drafters/draft_vocab.py's DraftVocab, set by `load`)
        for name, p in self.named_parameters():
            if p.dim() == 2 and not name.startswith("markov."):
                nn.init.normal_(p, std=0.02)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the drafter computes in (its norms'; its linears may be GGUF blocks, `quantize_q8act`)."""
        return self.norm.weight.dtype

    @property
    def quantized(self) -> bool:
        return not isinstance(self.fc, nn.Linear)

    def quantize_q8act(self, head: nn.Module, kind: str = "Q8_0") -> None:
        """Inference on verispec's CPU kernel beside a gguf-q8act target: every linear (W_c, the layers', DSpark's
        Markov W2 where its rank is a multiple of 32) rounded to `kind` blocks (Q8_0, Q4_1 or Q4_0) by gguf's
        quantizer, int8 activations per 32, and the logits through `head`, the target's own Q8_0 output head on the
        same kernel (the GGUF's blocks of the matrix the float path reads). A block forward then reads about a
        quarter (Q8_0) or an eighth (4-bit) of the float32 bytes; drafts change a little, verification keeps the
        output exact. Not for training or export. Block forwards and context K/V then run in a few kernel calls
        per layer (drafters/dflash_kernel.py)."""
        from verispec.drafters.dflash_kernel import DFlashKernel
        from verispec.kernels.q8act import round_linears

        assert self.dtype is torch.float32 and self.norm.weight.device.type == "cpu", "the q8act kernel is CPU fp32"
        kernel = DFlashKernel(self, kind)  # from the float weights: q | k | v, gate | up and the context k | v
        round_linears(self, ("fc",), kind)
        for layer in self.layers:
            round_linears(layer, LAYER_LINEARS, kind)
        if self.markov is not None and self.cfg.markov_rank % 32 == 0:  # the blocks are 32 wide
            round_linears(self.markov, ("w2",), kind)
        self.parts = replace(self.parts, out_head=head)
        self.kernel = kernel

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.cfg.feature_layers

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [n] -> cos, sin: [n, 1, hd] in the model's dtype."""
        if int(positions.max()) >= self.parts.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the target's RoPE table")
        dt = self.dtype
        return self.parts.rope_cos[positions].to(dt).unsqueeze(1), self.parts.rope_sin[positions].to(dt).unsqueeze(1)

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """feats: [n, len(layers) d] target features, positions: [n] -> per layer (k, v): [n, K, hd]."""
        if self.kernel is not None:
            return self.kernel.context_kv(feats, positions)
        h_ctx = self.hidden_norm(self.fc(feats.to(self.dtype)))  # [n, d]
        cos, sin = self.rope(positions)
        return [layer.kv(h_ctx, cos, sin) for layer in self.layers]

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors: [A] token ids -> [A, B, d]: the anchor's embedding, then B - 1 mask embeddings."""
        A, B = anchors.shape[0], self.cfg.block_size
        first = self.parts.rows(anchors).to(self.dtype).unsqueeze(1)  # [A, 1, d]
        return torch.cat([first, self.mask_embedding.expand(A, B - 1, -1)], dim=1)

    def block_hidden(self, x: torch.Tensor, positions: torch.Tensor,
                     ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], allowed: torch.Tensor | None) -> torch.Tensor:
        """x: [N, d] block rows at positions [N]; ctx_kv: per layer [C, K, hd] x 2 -> final-normed [N, d]."""
        cos, sin = self.rope(positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, allowed)
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [..., d] -> U: [..., V] float32 through the target's output matrix (with a draft vocabulary: its rows
        only, -inf at every other token)."""
        if self.vocab is not None:
            return self.vocab.logits(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], -1)
        if self.parts.out_head is not None:
            return self.parts.out_head(h)  # float32: `quantize_q8act` runs on float32 drafters only
        return F.linear(h, self.parts.out_weight.to(h.dtype)).float()

    def forward_train(self, feats: torch.Tensor, ctx_pos: torch.Tensor, ctx_seq: torch.Tensor, anchors: torch.Tensor,
                      anchor_pos: torch.Tensor, anchor_seq: torch.Tensor) -> torch.Tensor:
        """All anchors of several packed sequences in one forward.

        feats: [C, len(layers) d] feature rows, at positions ctx_pos [C] of sequences ctx_seq [C];
        anchors, anchor_pos, anchor_seq: [A]. Block a sees the context rows of its sequence strictly before its
        anchor and its own B rows (bidirectionally). Returns the final-normed block hidden states [A, B, d].
        """
        A, B = anchors.shape[0], self.cfg.block_size
        pos = (anchor_pos.unsqueeze(1) + torch.arange(B, device=anchors.device)).reshape(A * B)  # [A B]
        blk = torch.arange(A, device=anchors.device).repeat_interleave(B)  # [A B] block index of each row
        see_ctx = (anchor_seq[blk].unsqueeze(1) == ctx_seq) & (ctx_pos < anchor_pos[blk].unsqueeze(1))  # [A B, C]
        see_blk = blk.unsqueeze(1) == blk.unsqueeze(0)  # [A B, A B]
        allowed = torch.cat([see_ctx, see_blk], dim=1)
        h = self.block_hidden(self.block_inputs(anchors).reshape(A * B, -1), pos, self.context_kv(feats, ctx_pos),
                              allowed)
        return h.view(A, B, -1)

    # ---- checkpoint ----------------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        """config.json + model.safetensors with the drafter's own weights only (no target embedding / head)."""
        from safetensors.torch import save_file

        if self.quantized:
            raise ValueError(f"this drafter's linears were rounded to {self.fc.kind} blocks for inference; save the "
                             f"float drafter")
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        c = self.cfg
        cfg = {"architectures": ["DSparkDraftModel" if c.dspark else "DFlashDraftModel"],
               "model_type": "dspark" if c.dspark else "dflash", "block_size": c.block_size,
               "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
               "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
               "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
               "dflash_config": {"target_layer_ids": list(c.target_layer_ids), "mask": c.mask},
               "verispec_config": asdict(c)}
        if c.dspark:
            cfg["dspark_config"] = {"markov_rank": c.markov_rank,
                                    "confidence_temperatures": list(c.confidence_temperatures)}
        (out / "config.json").write_text(json.dumps(cfg, indent=1))
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("selector.")},
                  str(out / "model.safetensors"))
        if self.selector is not None:
            self.selector.save(out)

    @classmethod
    def from_pretrained(cls, directory: str | Path, target) -> "DFlashModel":
        """Load a checkpoint for `target` (a LlamaModel), in the target's dtype and device."""
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"{d} has no config.json: not a DFlash / DSpark checkpoint")
        raw = json.loads((d / "config.json").read_text())
        arch = raw.get("architectures", [])
        if arch not in (["DFlashDraftModel"], ["DSparkDraftModel"]) or "verispec_config" not in raw:
            raise ValueError(f"{d}: architectures {arch} is not a verispec DFlash / DSpark checkpoint")
        cfg = DFlashConfig(**raw["verispec_config"])
        t = target.cfg
        if (cfg.hidden_size, cfg.vocab_size, cfg.head_dim) != (t.hidden_size, t.vocab_size, t.head_dim):
            raise ValueError(f"{d} was trained for a target with hidden size {cfg.hidden_size}, vocabulary "
                             f"{cfg.vocab_size}, head_dim {cfg.head_dim}; this target has {t.hidden_size}, "
                             f"{t.vocab_size}, {t.head_dim}: use a drafter trained for this target")
        if max(cfg.feature_layers) > t.num_layers:
            raise ValueError(f"{d} reads target layers {cfg.target_layer_ids} but the target has {t.num_layers}")
        model = cls(cfg, TargetParts.of(target), init_mask=False).to(device=target.device, dtype=target.dtype)
        missing, unexpected = model.load_state_dict(load_file(str(d / "model.safetensors")), strict=False)
        if missing or unexpected:
            raise ValueError(f"{d}: weights do not fit the config (missing {missing[:5]}, unexpected {unexpected[:5]})")
        from verispec.drafters.path_selector import PathSelector

        selector = PathSelector.load(d)
        if selector is not None:
            if cfg.dspark or selector.cfg.hidden_size != cfg.hidden_size:
                raise ValueError(f"{d}: the path selector fits a DFlash drafter of hidden size "
                                 f"{selector.cfg.hidden_size}, not this {'DSpark' if cfg.dspark else 'DFlash'} one")
            model.selector = selector.to(device=target.device, dtype=target.dtype)
        return model.eval()

    def with_temperatures(self, temps: Sequence[float]) -> "DFlashModel":
        self.cfg = replace(self.cfg, confidence_temperatures=tuple(temps))
        return self
