"""Export a verispec EAGLE-3 head in the layout vLLM and SGLang load (`LlamaForCausalLMEagle3`).

Weights: fc, layers.0.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
mlp.{gate,up,down}_proj}, norm, lm_head [draft_vocab, d], d2t (int64, target = draft + d2t), t2d (bool [vocab]).
config.json: a one-layer Llama config with architectures ["LlamaForCausalLMEagle3"], draft_vocab_size,
target_hidden_size and the aux layer ids (top level and under eagle_config). The token embedding is the target's
and is not exported: both engines take it from the target model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from verispec.drafters.eagle3 import ARCH
from verispec.drafters.shipped import resolve

# verispec head parameter -> exported name
NAMES = {
    "fc.weight": "fc.weight",
    "input_layernorm": "layers.0.input_layernorm.weight",
    "hidden_norm": "layers.0.hidden_norm.weight",
    "q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
    "gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "up_proj.weight": "layers.0.mlp.up_proj.weight",
    "down_proj.weight": "layers.0.mlp.down_proj.weight",
    "norm": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}


def export_from_checkpoint(checkpoint: str, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    src = resolve(checkpoint)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("architectures") != ["VerispecEagle3Head"]:
        raise ValueError(f"{src} is not a verispec EAGLE-3 checkpoint (architectures {cfg.get('architectures')})")
    layers = list(cfg["feature_layers"])
    if len(layers) != 3:
        raise ValueError(f"vLLM and SGLang fuse exactly 3 aux layers; this head reads {len(layers)}")
    sd = load_file(str(src / "model.safetensors"))
    missing = set(NAMES) - set(sd)
    if missing:
        raise ValueError(f"{src} lacks {sorted(missing)}")
    out_sd = {}
    for k, name in NAMES.items():
        t = sd[k]
        if k == "d2t":
            t = t.to(torch.int64)
        elif k == "t2d":
            t = t.to(torch.bool)
        else:
            t = t.to(dtype)
        out_sd[name] = t.contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(out_sd, str(out / "model.safetensors"))
    config = {
        "architectures": [ARCH],
        "model_type": "llama",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_attention_heads": cfg["num_heads"],
        "num_key_value_heads": cfg["num_kv_heads"],
        "head_dim": cfg["head_dim"],
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "vocab_size": cfg["vocab_size"],
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": layers,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
