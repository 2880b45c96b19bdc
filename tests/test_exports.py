"""Every drafter export against what the loaders that serve it read, so that a format drift fails here and not in a
user's llama.cpp or vLLM.

The expectations are written out below from the loaders' own code (llama.cpp is not a dependency, so its converter
is not run here; `benchmarks/interop.py` runs it for real):
  - llama.cpp, from the llama-cpp-python 0.3.36 sdist: `conversion/llama.py` (LlamaModel: EAGLE-3 detected by
    `draft_vocab_size` with `num_hidden_layers == 1`; `eagle_aux_hidden_state_layer_ids`, `target_hidden_size`;
    `layers.0.*` renamed to `model.layers.0.*`; `d2t` written as d2t + arange, refused when out of range or
    duplicated; `t2d` skipped), `conversion/qwen.py` (DFlashModel: `dflash_config` {target_layer_ids,
    mask_token_id}, `block_size`, `mask_embedding.pt` read as {"mask_token_id": int, "embedding": [hidden_size]};
    DSparkModel: `transformer_layer_config` merged into the top level, `aux_hidden_state_layer_ids` - 1 as
    target_layer_ids, `sample_from_anchor`, `markov_head_type` "vanilla" only, `draft_vocab_size` <= vocab_size,
    d2t required below it), `conversion/__init__.py` (the architectures it routes), `gguf-py/gguf/tensor_mapping.py`
    (model.fc, model.hidden_norm, model.markov_head.markov_w{1,2}, model.confidence_head.proj) and
    `convert_hf_to_gguf.py` / `conversion/base.py` (get_model_architecture: a --target-model-dir must name its
    "architectures");
  - z-lab's DFlash (github z-lab/dflash, `dflash/model.py`, DFlashDraftModel): a Qwen3Config with `block_size`,
    `num_target_layers`, `layer_types`, `dflash_config` {target_layer_ids, mask_token_id}; module attributes
    `layers`, `norm`, `fc`, `hidden_norm` at the top level (no "model." prefix), no embedding nor head of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from verispec.drafters.dflash_export import export
from verispec.drafters.dflash_model import DFlashConfig, DFlashModel, TargetParts
from verispec.drafters.eagle3_export import export_from_checkpoint
from verispec.models.loader import HF_ARCHITECTURES, complete_hf_dir, load_model

# conversion/__init__.py: the architectures llama.cpp's converter routes to its EAGLE-3 / DFlash / DSpark classes
LLAMA_CPP_ARCHS = {"eagle3": {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator",
                              "Eagle3DraftModel"},
                   "dflash": {"DFlashDraftModel", "DFlash2DraftModel"},
                   "dspark": {"Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator", "Lfm2DSparkDraftModel",
                              "LingDSparkModel"}}
# the Qwen3 layer keys both DFlash loaders build their layers from (z-lab's Qwen3DFlashDecoderLayer, llama.cpp's
# Qwen3Model.set_gguf_parameters)
QWEN3_LAYER_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "rope_theta",
                    "max_position_embeddings", "attention_bias", "layer_types"}
V, D, LAYERS, EOS = 64, 32, 6, 7


def shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor of a safetensors file, from its header."""
    with safe_open(str(path), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS))
    d = tmp_path_factory.mktemp("target")
    hf.save_pretrained(d)
    return load_model(str(d), dtype="float32", device="cpu")[0]


def block_drafter(model, dspark: bool) -> DFlashModel:
    cfg = DFlashConfig.for_target(model.cfg, num_layers=2, block_size=5, dspark=dspark, markov_rank=6)
    return DFlashModel(cfg, TargetParts.of(model, dtype=torch.float32)).eval()


def check_backbone(w: dict, n_layers: int, n_feat: int, heads: int, kv: int, hd: int, ff: int) -> None:
    """The DFlash backbone's names and shapes, as z-lab's module tree and llama.cpp's mapping (after its
    "model." prefix) name them."""
    assert w["fc.weight"][0] == (D, n_feat * D)
    assert w["hidden_norm.weight"][0] == (D,) and w["norm.weight"][0] == (D,)
    for i in range(n_layers):
        p = f"layers.{i}."
        assert w[p + "self_attn.q_proj.weight"][0] == (heads * hd, D)
        assert w[p + "self_attn.k_proj.weight"][0] == (kv * hd, D) == w[p + "self_attn.v_proj.weight"][0]
        assert w[p + "self_attn.o_proj.weight"][0] == (D, heads * hd)
        assert w[p + "self_attn.q_norm.weight"][0] == (hd,) == w[p + "self_attn.k_norm.weight"][0]
        assert w[p + "mlp.gate_proj.weight"][0] == (ff, D) == w[p + "mlp.up_proj.weight"][0]
        assert w[p + "mlp.down_proj.weight"][0] == (D, ff)
        assert w[p + "input_layernorm.weight"][0] == (D,) == w[p + "post_attention_layernorm.weight"][0]
    assert not any(k.startswith("model.") for k in w), "z-lab's module tree has no model. prefix"


def test_dflash_layout_matches_llama_cpp_and_z_lab(target, tmp_path):
    m = block_drafter(target, False)
    out = export(m, target, tmp_path / "dflash", "dflash")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"][0] in LLAMA_CPP_ARCHS["dflash"] and conf["model_type"] == "qwen3"
    assert QWEN3_LAYER_KEYS <= set(conf) and len(conf["layer_types"]) == conf["num_hidden_layers"] == 2
    assert conf["block_size"] == 5 and conf["num_target_layers"] == LAYERS
    ids, mask_id = conf["dflash_config"]["target_layer_ids"], conf["dflash_config"]["mask_token_id"]
    assert ids == list(m.cfg.target_layer_ids) and all(0 <= i < LAYERS for i in ids)  # 0-based layer outputs
    assert mask_id == EOS and 0 <= mask_id < conf["vocab_size"] == V
    w = shapes(out / "model.safetensors")
    check_backbone(w, 2, len(ids), 4, 2, D // 4, 64)
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in w), "both loaders share the target's"
    # conversion/qwen.py DFlashModel.generate_extra_tensors: torch.load(weights_only=True), a dict
    mask = torch.load(out / "mask_embedding.pt", map_location="cpu", weights_only=True)
    assert set(mask) == {"mask_token_id", "embedding"} and mask["mask_token_id"] == mask_id
    assert tuple(mask["embedding"].shape) == (conf["hidden_size"],)
    torch.testing.assert_close(mask["embedding"].float(), m.mask_embedding.detach().to(torch.bfloat16).float())


def test_dspark_speculators_layout_matches_llama_cpp(target, tmp_path):
    m = block_drafter(target, True)
    out = export(m, target, tmp_path / "dspark", "speculators")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"][0] in LLAMA_CPP_ARCHS["dspark"]
    layer = conf["transformer_layer_config"]
    assert QWEN3_LAYER_KEYS <= set(layer)
    merged = {**conf, **layer}  # DSparkModel.__init__ merges the layer config into the top level
    aux = conf["aux_hidden_state_layer_ids"]  # HF hidden_states indices; llama.cpp takes aux - 1 as layer ids
    assert aux == [i + 1 for i in m.cfg.target_layer_ids] and all(1 <= i <= LAYERS for i in aux)
    assert conf["sample_from_anchor"] is False  # slot k >= 1 drafts p+k: llama.cpp's bonus-anchor block
    assert conf.get("markov_head_type", "vanilla") == "vanilla" and merged["block_size"] == 5
    assert conf["draft_vocab_size"] == merged["vocab_size"] == V  # no d2t needed at the full vocabulary
    assert 0 <= conf["mask_token_id"] < V
    w = shapes(out / "model.safetensors")
    check_backbone(w, 2, len(aux), 4, 2, D // 4, 64)
    r = conf["markov_rank"]
    assert w["markov_head.markov_w1.weight"][0] == (V, r) and w["markov_head.markov_w2.weight"][0] == (V, r)
    assert w["confidence_head.proj.weight"][0] == (1, D + r) and w["confidence_head.proj.bias"][0] == (1,)
    assert w["embed_tokens.weight"][0] == (V, D) and w["lm_head.weight"][0] == (V, D)
    assert "d2t" not in w


def test_eagle3_export_of_the_shipped_head_matches_llama_cpp(tmp_path):
    out = export_from_checkpoint("smollm2-135m-instruct-eagle3", str(tmp_path / "eagle3"))
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"][0] in LLAMA_CPP_ARCHS["eagle3"]
    assert conf["num_hidden_layers"] == 1 and "draft_vocab_size" in conf  # llama.cpp's EAGLE-3 detection
    aux, d, dt = conf["eagle_aux_hidden_state_layer_ids"], conf["hidden_size"], conf["target_hidden_size"]
    assert len(aux) == 3 and aux == conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    vd, v = conf["draft_vocab_size"], conf["vocab_size"]
    w = shapes(out / "model.safetensors")
    assert w["fc.weight"][0] == (d, 3 * dt)
    hd, heads, kv = conf["head_dim"], conf["num_attention_heads"], conf["num_key_value_heads"]
    assert w["layers.0.self_attn.q_proj.weight"][0] == (heads * hd, 2 * d)  # [embedding ; fused hidden] input
    assert w["layers.0.self_attn.k_proj.weight"][0] == (kv * hd, 2 * d) == w["layers.0.self_attn.v_proj.weight"][0]
    assert w["layers.0.hidden_norm.weight"][0] == (d,) == w["layers.0.input_layernorm.weight"][0]
    assert w["lm_head.weight"][0] == (vd, d) and w["norm.weight"][0] == (d,)
    assert w["d2t"] == ((vd,), "I64") and w["t2d"] == ((v,), "BOOL")
    from safetensors.torch import load_file

    t = load_file(str(out / "model.safetensors"))
    absolute = t["d2t"] + torch.arange(vd)  # what llama.cpp writes; it refuses ids out of range or repeated
    assert int(absolute.min()) >= 0 and int(absolute.max()) < v and absolute.unique().numel() == vd
    assert torch.equal(torch.nonzero(t["t2d"]).flatten(), absolute.sort().values)


def test_a_converted_directory_is_completed_in_place(tmp_path):
    """A directory converted before this rule (no architectures, no generation config, untagged weights) gains
    them, and transformers then loads it."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("architectures", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    save_file(load_file(str(tmp_path / "model.safetensors")), str(tmp_path / "model.safetensors"))  # no metadata
    complete_hf_dir(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [HF_ARCHITECTURES["llama"]]
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, EOS, EOS)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = torch.tensor([[3, 9, 27, 5]])
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits)


@pytest.mark.slow
def test_default_model_directory_is_a_complete_hf_model():
    """The directory verispec converts the default GGUF into: what llama.cpp's converter needs of a
    --target-model-dir (architectures, tokenizer, generation config) and what transformers loads, with logits equal
    to verispec's own model on the same ids (both float32 from the same dequantised weights: within 1e-4)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verispec.models.llama import Segment

    model, resolved = load_model("smollm2-135m-instruct", dtype="float32", device="cpu", progress=False)
    d = resolved.directory
    conf = json.loads((d / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"]
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == conf["eos_token_id"] and gen["bos_token_id"] == conf["bos_token_id"]
    assert (d / "tokenizer.json").is_file() and (d / "tokenizer_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(str(d))
    ids = tok("Speculative decoding drafts tokens and verifies them.")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    x = torch.tensor(ids)
    with torch.no_grad():
        ref = hf(x[None]).logits[0]
    cache = model.new_cache(64)
    out = model(x, [Segment(cache.allocate(), 0, len(ids))], cache, logits_indices=range(len(ids)))
    assert (out.logits - ref).abs().max().item() <= 1e-4
