"""HF checkpoint tensors into the decoder's fused weights: the names of transformers' LlamaForCausalLM / Qwen2 /
Qwen3 / Mistral (`model.layers.{i}.self_attn.q_proj.weight`, ...) copied into `LlamaModel`'s fused parameters
(`layer.qkv` = q | k | v, `layer.gate_up` = gate | up), shapes checked, every tensor accounted for."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from verispec.models.llama import Layer, LlamaModel
from verispec.models.mtp_layout import is_mtp_tensor


def load_hf_state_dict(model: LlamaModel, sd: Mapping[str, torch.Tensor]) -> None:
    """Copy weights named as in HF transformers' LlamaForCausalLM / Qwen2 / Qwen3 / Mistral into `model`."""
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        for key in (name, name.removeprefix("model."), "model." + name):
            if key in sd:
                used.add(key)
                return sd[key]
        raise KeyError(f"checkpoint has no tensor {name!r}")

    _put(model.embed, get("model.embed_tokens.weight"))
    _put(model.norm, get("model.norm.weight"))
    if model.lm_head is not None:
        _put(model.lm_head, get("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        load_layer(layer, f"model.layers.{i}.", get)
    c = model.cfg
    ignored = [k for k in sd if k not in used and "rotary_emb" not in k
               and not is_mtp_tensor(k, c.num_layers, c.mtp_layers)]  # MTP layers: a drafter's (drafters/mtp.py)
    if model.lm_head is None:
        ignored = [k for k in ignored if k != "lm_head.weight"]
    if ignored:
        raise ValueError(f"checkpoint tensors not used by the model (wrong architecture?): {ignored[:5]}")


def _put(param: torch.Tensor | None, value: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape."""
    assert param is not None
    if param.shape != value.shape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(value.shape)} vs model {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)


def load_layer(layer: Layer, p: str, get: Callable[[str], torch.Tensor]) -> None:
    """Fill one layer from HF's `model.layers.{i}.` tensors: q/k/v and gate/up fused in that order."""
    a, m = p + "self_attn.", p + "mlp."
    _put(layer.attn_norm, get(p + "input_layernorm.weight"))
    _put(layer.mlp_norm, get(p + "post_attention_layernorm.weight"))
    _put(layer.qkv, torch.cat([get(a + f"{n}_proj.weight") for n in "qkv"]))
    if layer.qkv_bias is not None:
        _put(layer.qkv_bias, torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"]))
    _put(layer.o, get(a + "o_proj.weight"))
    if layer.o_bias is not None:
        _put(layer.o_bias, get(a + "o_proj.bias"))
    if layer.q_norm is not None:
        _put(layer.q_norm, get(a + "q_norm.weight"))
        _put(layer.k_norm, get(a + "k_norm.weight"))
    _put(layer.gate_up, torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]))
    if layer.gate_up_bias is not None:
        _put(layer.gate_up_bias, torch.cat([get(m + "gate_proj.bias"), get(m + "up_proj.bias")]))
    _put(layer.down, get(m + "down_proj.weight"))
    if layer.down_bias is not None:
        _put(layer.down_bias, get(m + "down_proj.bias"))
