"""Synthetic GGUF files: a decoder's weights written with gguf's `GGUFWriter` in llama.cpp's layout, either given
(an HF model's state dict: the tests' tiny models) or random (the shapes of real models, for speed measurements).

Speed on a CPU is decided by the shapes (hidden size, layers, heads, KV heads, FFN width, vocabulary), not by the
weights' values, and the real weights of the models people run cannot be fetched here; `SHAPES` holds the
config.json values of four of them as published on their model cards. A random-weight file in one of those
shapes, with a tokenizer copied from another GGUF (padded with unused tokens to the model's vocabulary, as
llama.cpp's converter pads Qwen's), loads in llama.cpp and in verispec alike, and llama-quantize turns it into
the formats people download (`quantize`).

The layout follows llama.cpp's converter: tensor names (`token_embd`, `blk.N.attn_q`, ...), the llama
architecture's q / k rows permuted per head (transformers' GGUF reader undoes it), Qwen2's q / k / v biases,
Qwen3's per-head q / k RMSNorm weights, Llama-3's `llama3` RoPE scaling stored as the `rope_freqs` tensor of
per-frequency divisors, no `output.weight` where the head is tied to the embedding. 1-D tensors stay float32.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

# config.json values of the models whose shapes the benchmarks use (their model cards); head_dim where it is not
# hidden_size / heads, rope_scaling where the model has one
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=40960),
}

# HF parameter name inside a layer -> llama.cpp's tensor name inside `blk.N`
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def head_dim(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of an HF decoder parameter (KeyError for one it has no name for)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    if len(parts) != 4 or parts[:2] != ["model", "layers"]:
        raise KeyError(hf_name)
    return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"


def permute_heads(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's q / k rows (each head's rotary pairs as two halves) into llama.cpp's llama layout (pairs interleaved),
    per head: the order transformers' GGUF reader reverses."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, the RoPE scaling dict or {}) of an HF config dict, in either spelling (`rope_theta` and
    `rope_scaling`, or transformers 5's `rope_parameters`)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    return theta, params if params.get("rope_type", params.get("type", "default")) != "default" else {}


def llama3_freq_factors(cfg: Mapping[str, Any]) -> np.ndarray:
    """`rope_freqs`: the divisor of each RoPE frequency under Llama-3's scaling (1 above the high-frequency
    wavelength bound, `factor` below the low one, a smooth blend between), as llama.cpp's converter stores it."""
    theta, rs = rope(cfg)
    dim = head_dim(cfg)
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old = rs.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def random_tensors(cfg: Mapping[str, Any], seed: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """HF-named float32 weights of `cfg`'s shapes, N(0, 0.02) matrices and norms near 1, one at a time."""
    rng = np.random.default_rng(seed)
    d, hd, ff = cfg["hidden_size"], head_dim(cfg), cfg["intermediate_size"]
    nq, nkv, v = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["vocab_size"]

    def mat(n: int, k: int) -> np.ndarray:
        return rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02)

    def norm(n: int) -> np.ndarray:
        return 1 + rng.standard_normal(n, dtype=np.float32) * np.float32(0.05)

    yield "model.embed_tokens.weight", mat(v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm(d)
        yield p + "self_attn.q_proj.weight", mat(nq, d)
        yield p + "self_attn.k_proj.weight", mat(nkv, d)
        yield p + "self_attn.v_proj.weight", mat(nkv, d)
        if cfg["model_type"] == "qwen2":
            for name, n in (("q", nq), ("k", nkv), ("v", nkv)):
                yield p + f"self_attn.{name}_proj.bias", rng.standard_normal(n, dtype=np.float32) * np.float32(0.1)
        if cfg["model_type"] == "qwen3":
            yield p + "self_attn.q_norm.weight", norm(hd)
            yield p + "self_attn.k_norm.weight", norm(hd)
        yield p + "self_attn.o_proj.weight", mat(d, nq)
        yield p + "post_attention_layernorm.weight", norm(d)
        yield p + "mlp.gate_proj.weight", mat(ff, d)
        yield p + "mlp.up_proj.weight", mat(ff, d)
        yield p + "mlp.down_proj.weight", mat(d, ff)
    yield "model.norm.weight", norm(d)
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", mat(v, d)


def write_gguf(path: str | Path, cfg: Mapping[str, Any], tensors: Mapping[str, Any] | Iterator | None = None, *,
               float_type: str = "f16", tokenizer_from: str | Path | None = None, name: str = "synthetic",
               seed: int = 0) -> Path:
    """Write a GGUF of the decoder `cfg` (an HF config dict: model_type llama, qwen2 or qwen3) with `tensors`
    (HF names -> arrays or torch tensors; None: `random_tensors`), its matrices in `float_type` ("f16", "f32", or
    "q8_0": rounded by gguf's own Q8_0 quantizer, for where llama-quantize is not at hand),
    with the tokenizer of the GGUF `tokenizer_from` (padded to the vocabulary) or none."""
    import gguf

    arch = cfg["model_type"]
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"write_gguf writes llama, qwen2 and qwen3 decoders, not {arch!r}")
    if float_type not in ("f16", "f32", "q8_0"):
        raise ValueError(f"float_type is f16, f32 or q8_0, got {float_type!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    _write_metadata(w, cfg, name, float_type)
    if tokenizer_from is not None:
        copy_tokenizer(w, tokenizer_from, cfg["vocab_size"])
    items = random_tensors(cfg, seed) if tensors is None else (
        tensors.items() if isinstance(tensors, Mapping) else tensors)
    for hf_name, t in items:
        a = t.detach().float().cpu().numpy() if hasattr(t, "detach") else np.asarray(t, dtype=np.float32)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            a = permute_heads(a, cfg["num_attention_heads"])
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            a = permute_heads(a, cfg["num_key_value_heads"])
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings", False):
            continue  # tied: llama.cpp reads the embedding
        if a.ndim == 2 and float_type == "q8_0":
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name(hf_name), gguf.quants.quantize(a, q8), raw_dtype=q8)
        else:
            w.add_tensor(gguf_name(hf_name), a.astype(np.float16) if a.ndim == 2 and float_type == "f16" else a)
    scaling = rope(cfg)[1]
    if scaling and scaling.get("rope_type") != "llama3":
        raise ValueError(f"write_gguf writes llama3 RoPE scaling only, not {scaling}")
    if scaling:
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_metadata(w, cfg: Mapping[str, Any], name: str, float_type: str) -> None:
    import gguf

    w.add_name(name)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope(cfg)[0])
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_rope_dimension_count(head_dim(cfg))
    w.add_key_length(head_dim(cfg))
    w.add_value_length(head_dim(cfg))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "f32": gguf.LlamaFileType.ALL_F32,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[float_type])


def copy_tokenizer(w, source: str | Path, vocab_size: int) -> None:
    """Every `tokenizer.*` field of the GGUF `source` into the writer `w`; a token list shorter than the model's
    vocabulary is padded with unused `[PAD{i}]` tokens (the rows a model's embedding holds beyond its tokenizer)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        types = field.types
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if len(value) > vocab_size:
                raise ValueError(f"the tokenizer of {source} has {len(value)} tokens, more than the model's "
                                 f"vocabulary of {vocab_size}")
            pad = vocab_size - len(value)
            value = list(value) + ([f"[PAD{i}]" for i in range(pad)] if key.endswith("tokens") else
                                   [int(gguf.TokenType.UNUSED)] * pad if key.endswith("token_type") else [0.0] * pad)
        if types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, types[0], sub_type=types[-1])
        else:
            w.add_key_value(key, value, types[0])


def quantize(llama_quantize: str | Path, src: str | Path, dst: str | Path, kind: str, threads: int = 2,
             requantize: bool = False) -> Path:
    """`llama-quantize [--allow-requantize] src dst KIND threads` (llama.cpp's own tool, never a dependency of
    verispec: the benchmarks take its path); kept when dst exists and is newer than src."""
    dst = Path(dst)
    if dst.exists() and dst.stat().st_mtime >= Path(src).stat().st_mtime:
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    cmd = [str(llama_quantize), *(["--allow-requantize"] if requantize else []), str(src), str(tmp), kind,
           str(threads)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    tmp.replace(dst)
    return dst
