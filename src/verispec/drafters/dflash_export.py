"""Export a verispec DFlash / DSpark drafter in the layouts vLLM and SGLang load.

Both layouts share the backbone's names: fc, hidden_norm, norm and per draft layer
layers.{i}.{input_layernorm, post_attention_layernorm}, layers.{i}.self_attn.{q,k,v,o}_proj, layers.{i}.self_attn.
{q,k}_norm, layers.{i}.mlp.{gate,up,down}_proj. Our block convention is DFlash's: [anchor, mask x (B-1)] at
positions p..p+B-1, slot k >= 1 drafts token p+k through the target's output matrix; DSpark adds the Markov bias
W2 W1[x_{k-1}] and the confidence logit w^T [h_k ; W1 x_{k-1}] + b.

  speculators (vllm-project/speculators; vLLM loads it): `speculators_model_type` dflash / dspark, architectures
    DFlashSpeculator / DSparkSpeculator, `transformer_layer_config` (a Qwen3-style layer), `aux_hidden_state_layer_ids`
    (HF hidden_states indices: our feature layers), `block_size`, `mask_token_id`, `sample_from_anchor: false` (slot
    k drafts p+k, as ours). The draft owns `embed_tokens` (the target's table, whose mask_token_id row carries our
    learned mask vector) and `lm_head` (the target's output matrix); DSpark adds markov_head.markov_w{1,2} and
    confidence_head.proj (bias included) and our calibration temperatures under `verispec_confidence_temperatures`.
  dflash (z-lab's DFlashDraftModel; vLLM's and SGLang's DFlash loaders): a Qwen3 config with `block_size`,
    `num_target_layers` and `dflash_config` {target_layer_ids (0-based layers whose output is read), mask_token_id};
    no embedding or output matrix (the target's are shared) and the learned mask vector in `mask_embedding.pt`, a
    torch.save'd dict {"mask_token_id": int (= dflash_config.mask_token_id), "embedding": tensor [hidden_size]}: the
    layout llama.cpp's convert_hf_to_gguf.py reads (conversion/qwen.py, DFlashModel.generate_extra_tensors: it
    writes that row into the target's embedding table it embeds in the draft GGUF, so it needs --target-model-dir).
    z-lab's own DFlashDraftModel reads no such file: it, and any engine that ignores the file, embeds
    mask_token_id's own row of the target's table (worse drafts, never other output).
    DSpark has no layout here: DeepSpec's and SGLang's DSpark train slot k to draft p+k+1, a different model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from verispec.config import ModelConfig
from verispec.drafters.dflash_model import DFlashModel
from verispec.models.loader import HF_ARCHITECTURES

FORMATS = ("speculators", "dflash")
MASK_FILE = "mask_embedding.pt"  # the dflash layout's learned mask vector, {"mask_token_id": int, "embedding": [d]}
_LAYER = {"input_layernorm.weight": "input_layernorm.weight", "post_attention_layernorm.weight":
          "post_attention_layernorm.weight", "q_proj.weight": "self_attn.q_proj.weight", "k_proj.weight":
          "self_attn.k_proj.weight", "v_proj.weight": "self_attn.v_proj.weight", "o_proj.weight":
          "self_attn.o_proj.weight", "q_norm.weight": "self_attn.q_norm.weight", "k_norm.weight":
          "self_attn.k_norm.weight", "gate_proj.weight": "mlp.gate_proj.weight", "up_proj.weight":
          "mlp.up_proj.weight", "down_proj.weight": "mlp.down_proj.weight"}


def backbone_names(model: DFlashModel) -> dict[str, str]:
    """Our state-dict key -> the exported name, for the backbone (both layouts)."""
    names = {"fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
    for i in range(model.cfg.num_layers):
        names |= {f"layers.{i}.{k}": f"layers.{i}.{v}" for k, v in _LAYER.items()}
    return names


def layer_config(model: DFlashModel, target: ModelConfig) -> dict:
    """The draft layers as a Qwen3-style HF config (what both layouts describe the backbone with)."""
    c = model.cfg
    conf = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu", "attention_bias": False,
            "tie_word_embeddings": False, "max_position_embeddings": target.max_position_embeddings,
            "rope_theta": target.rope_theta, "layer_types": ["full_attention"] * c.num_layers,
            "use_sliding_window": False}
    if target.rope_type != "default":
        conf["rope_scaling"] = {"rope_type": target.rope_type, "factor": target.rope_factor,
                                "low_freq_factor": target.rope_low_freq_factor,
                                "high_freq_factor": target.rope_high_freq_factor,
                                "original_max_position_embeddings": target.rope_original_max_positions}
    return conf


def default_mask_token(target: ModelConfig) -> int:
    """The target's first end-of-sequence id: decoding never drafts after an EOS anchor, so its embedding row is
    the one least often needed as an anchor (override with --mask-token-id)."""
    if not target.eos_token_ids:
        raise ValueError("the target names no EOS token: pass --mask-token-id")
    return int(target.eos_token_ids[0])


def export(model: DFlashModel, target, out_dir: str | Path, fmt: str = "speculators", mask_token_id: int | None = None,
           verifier: str = "", dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `model` (trained for the LlamaModel `target`) to out_dir in layout `fmt`; returns out_dir."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {FORMATS}")
    c, t = model.cfg, target.cfg
    if fmt == "dflash" and c.dspark:
        raise ValueError("DSpark exports only in the speculators layout (--format speculators): DeepSpec's and "
                         "SGLang's DSpark draft p+k+1 from slot k, ours drafts p+k")
    mask = default_mask_token(t) if mask_token_id is None else int(mask_token_id)
    if not 0 <= mask < c.vocab_size:
        raise ValueError(f"mask_token_id {mask} is outside the vocabulary (0..{c.vocab_size - 1})")
    if model.selector is not None:
        import warnings

        warnings.warn("the DFlash 2 path selector is not exported: vLLM and SGLang have no such module, so the "
                      "export drafts as plain DFlash", stacklevel=2)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = {new: sd[old] for old, new in backbone_names(model).items()}
    mask_vec = sd["mask_embedding"].detach()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = layer_config(model, t)
    if fmt == "speculators":
        embed = model.parts.embed.detach().clone()
        embed[mask] = mask_vec.to(embed.dtype)
        tensors |= {"embed_tokens.weight": embed, "lm_head.weight": model.parts.out_weight.detach()}
        if c.dspark:
            assert model.markov is not None
            tensors |= {"markov_head.markov_w1.weight": sd["markov.w1.weight"],
                        "markov_head.markov_w2.weight": sd["markov.w2.weight"],
                        "confidence_head.proj.weight": sd["markov.confidence.weight"],
                        "confidence_head.proj.bias": sd["markov.confidence.bias"]}
        config = _speculators_config(model, layers, mask, verifier, HF_ARCHITECTURES.get(t.model_type, "LlamaForCausalLM"))
    else:
        torch.save({"mask_token_id": mask, "embedding": mask_vec.to(dtype).clone()}, out / MASK_FILE)
        config = {**layers, "architectures": ["DFlashDraftModel"], "block_size": c.block_size,
                  "num_target_layers": t.num_layers,
                  "dflash_config": {"target_layer_ids": list(c.target_layer_ids), "mask_token_id": mask}}
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def _speculators_config(model: DFlashModel, layers: dict, mask: int, verifier: str, arch: str) -> dict:
    c = model.cfg
    kind = "dspark" if c.dspark else "dflash"
    conf = {"architectures": ["DSparkSpeculator" if c.dspark else "DFlashSpeculator"],
            "speculators_model_type": kind, "transformer_layer_config": layers, "draft_vocab_size": c.vocab_size,
            "block_size": c.block_size, "target_hidden_size": c.hidden_size,
            "aux_hidden_state_layer_ids": list(c.feature_layers), "mask_token_id": mask,
            "sample_from_anchor": False,
            "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": c.block_size - 1,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"name_or_path": verifier, "architectures": [arch]}}}
    if c.dspark:
        conf |= {"markov_rank": c.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
                 "confidence_head_with_markov": True,
                 "verispec_confidence_temperatures": list(c.confidence_temperatures)}
    return conf
