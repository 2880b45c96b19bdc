"""The gguf-q8act path's light load: the decoder built straight from the GGUF file, never holding a dense copy of
its linears or embedding.

`LlamaModel` is built on the meta device (shapes, no memory); then, tensor by tensor (each read into memory of its
own, repacked, and dropped): every fused linear whose parts are in the kernel's formats becomes a `Q8ActWeight`
from the file's blocks (the same modules `quantize_q8act` installs after a dense load: same bytes, same order, so
the logits are those of that path), the head too; the small tensors (norms, biases, Qwen3's q / k norms, and any
linear whose format has no kernel body, which stays dense) are dequantised by gguf's own `gguf.quants.dequantize`,
as transformers' GGUF reader does, with llama.cpp's q / k row permutation undone for arch "llama". The embedding
is a `GGUFEmbedding` (models/gguf_embedding.py): rows dequantised at lookup, from bytes held (untied) or read from
the file (tied: the head already holds those rows, repacked); a drafter that reads `embed` / `lm_head` as a tensor
gets it built on first access.

GGUF names -> the decoder's: token_embd -> embed, output_norm -> norm, output -> lm_head; in blk.N: attn_norm,
ffn_norm -> attn_norm, mlp_norm; attn_q | attn_k | attn_v -> qkv (and their .bias -> qkv_bias), attn_output -> o,
ffn_gate | ffn_up -> gate_up, ffn_down -> down; attn_q_norm, attn_k_norm -> q_norm, k_norm.
A file this cannot cover (a missing or unknown tensor, a shape that does not match the config) returns None, and
the loader takes the dense path, saying why on stderr.
"""

from __future__ import annotations

import os
import sys
from itertools import chain

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from verispec.config import ModelConfig
from verispec.kernels.cpu import release_freed_memory
from verispec.models.gguf_blocks import KERNEL_FORMATS
from verispec.models.gguf_embedding import GGUFEmbedding
from verispec.models.gguf_index import GGUFIndex
from verispec.models.llama import Layer, LlamaModel
from verispec.models.quantized import _fused_tensors, _swap, finish_q8act, q8act_head, q8act_weight, report_fallbacks

# tensors of a GGUF that configure rather than weigh (read into config.json by the converter)
CONFIG_TENSORS = ("rope_freqs.weight",)


class Uncovered(ValueError):
    """The file holds or lacks something the light load does not map: the dense path takes the model."""


def load_q8act_direct(gguf_path: str | os.PathLike, cfg: ModelConfig, dtype: torch.dtype, rope_len: int
                      ) -> LlamaModel | None:
    """The gguf-q8act decoder of `gguf_path` (config `cfg`, weights in `dtype`, RoPE tables for `rope_len`
    positions), built without dense linears; None (said on stderr) where the file cannot be covered."""
    reader = GGUFIndex.open(gguf_path)
    report_fallbacks(str(gguf_path))
    with torch.device("meta"):
        net = LlamaModel(cfg, rope_len=1)
    used: set[str] = set()
    try:
        for i, layer in enumerate(net.layers):
            used |= _load_layer(reader, net, i, layer, dtype)
            release_freed_memory()
        _put(net, "norm", dense_tensor(reader, "output_norm.weight", dtype))
        used |= {"output_norm.weight"} | _load_ends(reader, net, dtype)
        release_freed_memory()
        extra = set(reader.tensors) - used - set(CONFIG_TENSORS) - ({"output.weight"} if cfg.tie_word_embeddings
                                                                    else set())
        if extra:
            raise Uncovered(f"tensors the decoder does not map: {sorted(extra)[:5]}")
    except (KeyError, Uncovered) as e:
        print(f"verispec: {os.path.basename(gguf_path)}: the light gguf-q8act load cannot cover this file ({e}); "
              "loading through a dense copy instead", file=sys.stderr, flush=True)
        return None
    left = [n for n, t in chain(net.named_parameters(), net.named_buffers()) if t.is_meta and not n.startswith("rope")]
    if left:
        raise RuntimeError(f"the light load left {left[:5]} unset")  # a bug here, not in the file
    net.set_rope_length(rope_len)
    net.rope_cos = net.rope_cos.to(dtype).float()  # rounded to the weights' dtype as the dense load's .to() does
    net.rope_sin = net.rope_sin.to(dtype).float()
    finish_q8act(net)
    return net.eval()


def dense_tensor(reader: GGUFIndex, name: str, dtype: torch.dtype, heads: int | None = None) -> torch.Tensor:
    """Tensor `name` dequantised by gguf ([N, K] or [N]) in `dtype`; rows un-permuted for `heads` heads."""
    from verispec.models.quantized import unpermute_rows

    e = reader.entry(name)
    rows = int(np.prod(e.shape[1:])) if len(e.shape) > 1 else 1
    w = dequantize(reader.read(name).reshape(rows, -1), GGMLQuantizationType[e.kind])
    w = w.reshape(-1) if len(e.shape) == 1 else w.reshape(rows, int(e.shape[0]))
    if heads is not None:
        w = w[unpermute_rows(w.shape[0], heads)]
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(dtype)


def _put(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """The meta parameter `name` of `module` becomes `value` (same shape, else `Uncovered`)."""
    want = tuple(getattr(module, name).shape)
    if tuple(value.shape) != want:
        raise Uncovered(f"{name}: the file's {tuple(value.shape)} against the config's {want}")
    setattr(module, name, nn.Parameter(value))


def _load_layer(reader: GGUFIndex, net: LlamaModel, i: int, layer: Layer, dtype: torch.dtype) -> set[str]:
    """Layer i's weights from blk.i.*: kernel modules where every part of a fused linear has a body, dense
    elsewhere. Returns the tensor names used."""
    p = f"blk.{i}."
    used = {p + "attn_norm.weight", p + "ffn_norm.weight"}
    _put(layer, "attn_norm", dense_tensor(reader, p + "attn_norm.weight", dtype))
    _put(layer, "mlp_norm", dense_tensor(reader, p + "ffn_norm.weight", dtype))
    if layer.q_norm is not None:
        used |= {p + "attn_q_norm.weight", p + "attn_k_norm.weight"}
        _put(layer, "q_norm", dense_tensor(reader, p + "attn_q_norm.weight", dtype))
        _put(layer, "k_norm", dense_tensor(reader, p + "attn_k_norm.weight", dtype))
    native = {f for f, _ in _fused_tensors(reader, net, i, lambda kinds: kinds <= set(KERNEL_FORMATS))}
    for fused, parts in _fused_tensors(reader, net, i, lambda kinds: True):
        used |= {n for n, _ in parts}
        want = tuple(getattr(layer, fused).shape)
        if fused in native:
            packed = q8act_weight(reader, parts)
            if packed.shape != want:
                raise Uncovered(f"layer {i} {fused}: the file's {packed.shape} against the config's {want}")
            _swap(layer, fused, packed)
        else:  # a format without a kernel body: dense, as the dense load holds it
            _put(layer, fused, torch.cat([dense_tensor(reader, n, dtype, h) for n, h in parts]))
        biases = [(n.removesuffix(".weight") + ".bias", h) for n, h in parts]
        if getattr(layer, fused + "_bias") is not None:
            used |= {n for n, _ in biases}
            _put(layer, fused + "_bias", torch.cat([dense_tensor(reader, n, dtype, h) for n, h in biases]))
    return used


def _load_ends(reader: GGUFIndex, net: LlamaModel, dtype: torch.dtype) -> set[str]:
    """The embedding and the head. Returns the tensor names used."""
    cfg = net.cfg
    tied, v, d = cfg.tie_word_embeddings, cfg.vocab_size, cfg.hidden_size
    emb = reader.entry("token_embd.weight")
    head_name = "token_embd.weight" if tied else "output.weight"
    if emb.shape != (d, v) or reader.entry(head_name).shape != (d, v):
        raise Uncovered(f"embedding / head shapes {emb.shape}, {reader.entry(head_name).shape} against the "
                        f"config's [{v}, {d}]")
    native = reader.entry(head_name).kind in KERNEL_FORMATS
    if native:
        net.head_weight = q8act_head(reader, head_name)
    del net.embed
    if tied and not native:  # the head runs dense on the embedding: one dense table serves both
        net.embed = nn.Parameter(dense_tensor(reader, "token_embd.weight", dtype))
    else:
        row_bytes = emb.nbytes // v
        net.embedding = (GGUFEmbedding.from_file(reader.path, emb.offset, emb.kind, v, d, row_bytes, dtype) if tied
                         else GGUFEmbedding.held(reader.read("token_embd.weight").reshape(v, row_bytes), emb.kind,
                                                 d, dtype))
        net.dense_on_demand["embed"] = net.embedding.dense
    if not tied:
        del net.lm_head
        if native:
            net.dense_on_demand["lm_head"] = lambda: dense_tensor(reader, "output.weight", dtype)
        else:
            net.lm_head = nn.Parameter(dense_tensor(reader, "output.weight", dtype))
    return {"token_embd.weight", head_name}
