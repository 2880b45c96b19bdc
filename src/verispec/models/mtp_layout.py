"""Where a target checkpoint keeps its native multi-token-prediction (MTP) layers, and how each layout combines the
target's hidden state with the next token's embedding. Pure name logic: no tensors are read here.

Each MTP layer i predicts one token further: at position j it reads the target's hidden state h_j (or, chained,
the previous step's MTP state) and the embedding e of token x_{j+1}, and its logits there draft x_{j+2}:

  x   = proj(cat(parts))            parts = norm_e(e), norm_h(h) in the layout's order            [n, d] (proj: 2d -> d)
  o   = block(x)                    one decoder layer (pre-norm attention + MLP, residual inside)  [n, d]
  out = layout-specific: the state chained to the next step and the logits (see `MTPLayout`)

The three layouts, as vLLM reads them (deepseek_mtp.py, mimo_mtp.py, qwen3_next_mtp.py; L = num_hidden_layers):
  deepseek_v3  model.layers.{L+i}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens} and the
               block's tensors under the same prefix; x = eh_proj([enorm(e); hnorm(h)]); h = the target's state after
               its final norm; the chained state is o, logits = shared_head.head(shared_head.norm(o)); e = 0 at
               position 0.
  mimo         model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm} and the block's
               tensors under the same prefix; x = input_proj([hidden_layernorm(h); token_layernorm(e)]); h = the
               target's state BEFORE its final norm (vLLM's MiMoModel returns it un-normed); the chained state is
               final_layernorm(o), logits = lm_head(that); e = 0 at position 0.
  qwen3_next   mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm} and mtp.layers.{i}.* for the block;
               x = fc([pre_fc_norm_embedding(e); pre_fc_norm_hidden(h)]); h = after the target's final norm; the
               chained state is norm(o), logits = lm_head(that); every RMSNorm is zero-centred (scale 1 + w).
The configs name the layer count `num_nextn_predict_layers`.

verispec runs an MTP block that is a Llama-family decoder layer (dense SwiGLU MLP, grouped-query attention, with the
target's q/k/v bias and q/k norm). DeepSeek-V3's multi-head latent attention, mixture-of-experts MLPs and
Qwen3-Next's gated attention are refused by name, as are layouts whose tensors are missing or miscounted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence


class MTPLayoutError(ValueError):
    """The checkpoint's MTP tensors are absent, incomplete, or in a block verispec cannot run."""


@dataclass(frozen=True)
class MTPLayout:
    name: str
    # tensor-name templates: "{i}" is the MTP layer's index, "{j}" = num_hidden_layers + i
    emb_norm: str
    hidden_norm: str
    proj: str
    emb_first: bool  # cat([norm_e(e); norm_h(h)]) when True, cat([norm_h(h); norm_e(e)]) when False
    out_norm: str  # a full tensor name template (may sit outside the layer's prefix)
    norm_feeds_chain: bool  # True: the chained state and the logits read out_norm(o); False: only the logits do
    block_prefix: str  # where the block's input_layernorm / self_attn / post_attention_layernorm / mlp live
    target_post_norm: bool  # h = the target's state after its final norm (True) or before it (False)
    mask_first_embedding: bool  # e = 0 at position 0, as vLLM does for this layout
    zero_centred_norms: bool  # RMSNorm scale is 1 + w (Qwen3-Next) instead of w
    own_head: str | None = None  # the layer's own LM head, when the layout may ship one
    own_embed: str | None = None  # the layer's own token embedding, when the layout may ship one

    def names(self, i: int, num_layers: int) -> dict[str, str]:
        """The layer's combination tensors by role: emb_norm, hidden_norm, proj, out_norm (+ head, embed)."""
        fill = {"i": i, "j": num_layers + i}
        out = {role: getattr(self, role).format(**fill) for role in ("emb_norm", "hidden_norm", "proj", "out_norm")}
        for role in ("own_head", "own_embed"):
            template = getattr(self, role)
            if template is not None:
                out[role] = template.format(**fill)
        return out

    def block(self, i: int, num_layers: int) -> str:
        return self.block_prefix.format(i=i, j=num_layers + i)


LAYOUTS: dict[str, MTPLayout] = {
    "deepseek_v3": MTPLayout(
        "deepseek_v3", "model.layers.{j}.enorm.weight", "model.layers.{j}.hnorm.weight",
        "model.layers.{j}.eh_proj.weight", True, "model.layers.{j}.shared_head.norm.weight", False,
        "model.layers.{j}.", target_post_norm=True, mask_first_embedding=True, zero_centred_norms=False,
        own_head="model.layers.{j}.shared_head.head.weight", own_embed="model.layers.{j}.embed_tokens.weight"),
    "mimo": MTPLayout(
        "mimo", "model.mtp_layers.{i}.token_layernorm.weight",
        "model.mtp_layers.{i}.hidden_layernorm.weight", "model.mtp_layers.{i}.input_proj.weight", False,
        "model.mtp_layers.{i}.final_layernorm.weight", True, "model.mtp_layers.{i}.", target_post_norm=False,
        mask_first_embedding=True, zero_centred_norms=False),
    "qwen3_next": MTPLayout(
        "qwen3_next", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
        True, "mtp.norm.weight", True, "mtp.layers.{i}.", target_post_norm=True, mask_first_embedding=False,
        zero_centred_norms=True),
}

# the block's tensors, relative to its prefix (a Llama-family decoder layer in HF names)
BLOCK_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
# tensor-name fragments of blocks verispec does not run, and what they are
FOREIGN_BLOCKS = (("q_a_proj", "multi-head latent attention (DeepSeek MLA)"),
                  ("kv_a_proj_with_mqa", "multi-head latent attention (DeepSeek MLA)"),
                  ("mlp.experts.", "a mixture-of-experts MLP"), ("mlp.gate.weight", "a mixture-of-experts router"),
                  ("mlp.shared_expert", "a mixture-of-experts shared expert"),
                  ("linear_attn.", "linear attention (gated DeltaNet)"))

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def config_layers(cfg: Mapping) -> int:
    """How many MTP layers the config declares (`num_nextn_predict_layers`, 0 when absent)."""
    return int(cfg.get("num_nextn_predict_layers") or 0)


def is_mtp_tensor(name: str, num_layers: int, mtp_layers: int) -> bool:
    """Whether a checkpoint tensor belongs to a declared MTP layer (the target's loader leaves those out)."""
    if mtp_layers <= 0:
        return False
    if name.startswith(("model.mtp_layers.", "mtp.")):
        return True
    m = _LAYER.match(name)
    return m is not None and num_layers <= int(m.group(1)) < num_layers + mtp_layers


def detect(cfg: Mapping, names: Collection[str], where: str = "the checkpoint") -> tuple[MTPLayout, int]:
    """(the layout, its layer count) of the MTP tensors in `names`, or MTPLayoutError saying what is wrong."""
    num_layers = int(cfg["num_hidden_layers"])
    declared = config_layers(cfg)
    found = [lay for lay in LAYOUTS.values() if _present(lay, names, num_layers)]
    if not found:
        hint = (f"config.json declares num_nextn_predict_layers = {declared} but " if declared else "")
        raise MTPLayoutError(
            f"{where} ships no MTP layers: {hint}none of the known layouts' tensors are present "
            f"({_first_names(num_layers)}); --method mtp needs a target trained with MTP heads (DeepSeek-V3, MiMo, "
            "Qwen3-Next layouts); use another speculative method for this model")
    if len(found) > 1:
        raise MTPLayoutError(f"{where} holds MTP tensors of several layouts ({', '.join(f.name for f in found)})")
    layout = found[0]
    count = _count(layout, names, num_layers)
    if declared and declared != count:
        raise MTPLayoutError(f"{where}: config.json declares num_nextn_predict_layers = {declared} but the "
                             f"{layout.name} layout's tensors hold {count} MTP layer(s)")
    return layout, count


def problems(layout: MTPLayout, names: Collection[str], num_layers: int, count: int) -> list[str]:
    """What stops verispec from running these MTP layers: foreign blocks, then missing tensors ([] = runnable)."""
    out: list[str] = []
    for i in range(count):
        block = layout.block(i, num_layers)
        inside = [n for n in names if n.startswith(block)]
        foreign = next((what for fragment, what in FOREIGN_BLOCKS if any(fragment in n for n in inside)), None)
        if foreign is not None:
            out.append(f"MTP layer {i} ({block}*) is {foreign}, which verispec's Llama-family block does not run")
            continue
        need = [n for role, n in layout.names(i, num_layers).items() if not role.startswith("own_")]  # own_*: optional
        missing = [n for n in need + [block + t for t in BLOCK_TENSORS] if n not in names]
        if missing:
            out.append(f"MTP layer {i} of the {layout.name} layout misses {len(missing)} tensor(s): "
                       f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    return out


def _present(layout: MTPLayout, names: Collection[str], num_layers: int) -> bool:
    return layout.names(0, num_layers)["proj"] in names


def _count(layout: MTPLayout, names: Collection[str], num_layers: int) -> int:
    """Layers 0, 1, ... while some tensor sits under the layer's block prefix."""
    i = 0
    while any(n.startswith(layout.block(i, num_layers)) for n in names):
        i += 1
    return i


def _first_names(num_layers: int) -> str:
    return ", ".join(lay.names(0, num_layers)["proj"] for lay in LAYOUTS.values())


def block_intermediate(shapes: Mapping[str, Sequence[int]], layout: MTPLayout, i: int, num_layers: int) -> int:
    """The block's MLP width, read from its gate_proj (an MTP block may differ from the target's layers)."""
    return int(shapes[layout.block(i, num_layers) + "mlp.gate_proj.weight"][0])
