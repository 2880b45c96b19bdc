"""Read an exported `LlamaForCausalLMEagle3` directory back into verispec's EAGLE-3 layout, so the doctor can run
what vLLM / SGLang would load (the inverse of drafters/eagle3_export.py; the export's config is trusted as is)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from verispec.drafters.eagle3_export import NAMES


def import_export(export_dir: str | Path, out_dir: str | Path) -> Path:
    """export_dir (config.json + model.safetensors, export names) -> out_dir in the verispec layout."""
    src, out = Path(export_dir), Path(out_dir)
    c = json.loads((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    back = {exported: ours for ours, exported in NAMES.items()}
    missing = sorted(set(back) - set(sd))
    extra = sorted(set(sd) - set(back))
    if missing or extra:
        raise ValueError(f"{src}: exported tensors do not match the LlamaForCausalLMEagle3 names (missing "
                         f"{missing[:5]}, unexpected {extra[:5]})")
    cfg = {"architectures": ["VerispecEagle3Head"], "hidden_size": c["hidden_size"],
           "num_heads": c["num_attention_heads"], "num_kv_heads": c["num_key_value_heads"], "head_dim": c["head_dim"],
           "intermediate_size": c["intermediate_size"], "rms_norm_eps": c["rms_norm_eps"],
           "vocab_size": c["vocab_size"], "draft_vocab_size": c["draft_vocab_size"],
           "feature_layers": list(c["eagle_aux_hidden_state_layer_ids"]),
           "target_hidden_size": c["target_hidden_size"], "rope_theta": c["rope_theta"],
           "max_position_embeddings": c["max_position_embeddings"]}
    out.mkdir(parents=True, exist_ok=True)
    save_file({back[k]: v.float().contiguous() if v.is_floating_point() else v.contiguous() for k, v in sd.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
