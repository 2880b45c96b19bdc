"""GGUF-quantised decoders: the dense decoder loaded first, then its linears replaced by kernel modules built from
the file's own blocks (no requantisation).
- `quantization="gguf"` (`quantize_from_gguf`, bf16): every linear whose GGUF tensors are all Q4_0 / Q4_1 becomes
  an `Int4Weight` (kernels/int4.py: aten's CPU int4 kernel, bf16 activations). The head stays dense.
- `quantization="gguf-q8act"` (`quantize_q8act`, fp32 activations): every linear whose GGUF tensors share one of
  Q4_0 / Q4_1 / Q8_0 becomes a `Q8ActWeight` (kernels/q8act.py: verispec's kernel, int8 activations per 32, as
  llama.cpp computes), and so does the output head (the tied embedding's blocks, or `output.weight`); attention
  runs on verispec's fp32 CPU kernel (`Library.attention`).
Fused weights stack their parts along N as the HF loader does (qkv = q, k, v; gate_up = gate, up). llama.cpp
stores a "llama" model's q and k rows permuted for its RoPE layout; they are un-permuted here exactly as
transformers' GGUF loader does, so row i of every weight is the dense model's row i. Norms, biases and the
embedding stay dense; a linear in any other format (K-quants, F16) stays dense too.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

import numpy as np
from torch import nn

from verispec.kernels.int4 import GROUP, N_MULTIPLE, Int4Weight
from verispec.models.gguf_blocks import FORMATS, Blocks, raw_rows, read_blocks, tensor_kind
from verispec.models.gguf_index import GGUFIndex
from verispec.models.llama import LlamaModel

INT4_KINDS = ("Q4_0", "Q4_1")
# fused weight of `Layer` -> the GGUF tensors (blk.{i}.<name>.weight) stacked along N, in order
FUSED: dict[str, tuple[str, ...]] = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
                                     "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}


def unpermute_rows(n: int, heads: int) -> np.ndarray:
    """Row indices [n] undoing llama.cpp's q/k permutation for `heads` heads, as transformers'
    `_reverse_permute_weights` does: rows viewed as [heads, n / heads / 2, 2], the last two axes swapped."""
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _fused_tensors(reader: GGUFIndex, model: LlamaModel, index: int, accept: Callable[[set[str]], bool]
                   ) -> Iterator[tuple[str, list[tuple[str, int | None]]]]:
    """Layer `index`'s fused weights whose parts' GGML types `accept` takes: (fused name, [(tensor name, heads to
    un-permute its rows by, or None)]); llama.cpp permutes a "llama" model's q and k rows."""
    cfg, permuted = model.cfg, reader.arch == "llama"
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    for fused, parts in FUSED.items():
        names = [f"blk.{index}.{p}.weight" for p in parts]
        if accept({tensor_kind(reader, n) for n in names}):
            yield fused, [(n, heads[p] if permuted and p in heads else None) for p, n in zip(parts, names)]


def _swap(layer: nn.Module, name: str, module: nn.Module) -> None:
    """The dense parameter `name` goes; the kernel module takes its name."""
    delattr(layer, name)
    setattr(layer, name, module)


def layer_blocks(reader: GGUFIndex, model: LlamaModel, index: int) -> dict[str, list[Blocks]]:
    """Layer `index`'s fused weights whose parts are all Q4_0 / Q4_1: name -> the parts' `Blocks` in the dense
    model's row order."""
    out: dict[str, list[Blocks]] = {}
    for fused, parts in _fused_tensors(reader, model, index, lambda kinds: kinds <= set(INT4_KINDS)):
        blocks = [read_blocks(reader, n) for n, _ in parts]
        out[fused] = [b if h is None else b.take_rows(unpermute_rows(b.shape[0], h))
                      for b, (_, h) in zip(blocks, parts)]
    return out


def quantize_from_gguf(model: LlamaModel, gguf_path: str | os.PathLike) -> int:
    """Replace `model`'s Q4_0 / Q4_1 linears (a bf16 CPU model loaded from `gguf_path`) with `Int4Weight`s, in
    place. Returns how many were replaced."""
    reader = GGUFIndex.open(gguf_path)
    replaced = 0
    for i, layer in enumerate(model.layers):
        for name, blocks in layer_blocks(reader, model, i).items():
            dense = getattr(layer, name)  # [N, K]
            n, k = dense.shape
            if sum(b.shape[0] for b in blocks) != n or any(b.shape[1] != k for b in blocks):
                raise ValueError(f"layer {i} {name}: GGUF blocks {[b.shape for b in blocks]} vs model {(n, k)}")
            if n % N_MULTIPLE or k % GROUP:
                continue  # the CPU int4 packing cannot hold this shape: stays dense
            _swap(layer, name, Int4Weight.from_q4([(b.q, b.scale, b.min) for b in blocks], dtype=dense.dtype))
            replaced += 1
    model.batch_invariant = True  # the int4 and dense bf16 linears are row-wise invariant; attention follows suit
    return replaced


def gguf_block_linears(gguf_path: str | os.PathLike | None) -> bool:
    """Whether a GGUF's first layer's linears are all in formats verispec's kernel runs natively (the gguf-q8act
    path's candidacy under dtype="auto"): any mix of them, each tensor on its own format."""
    if gguf_path is None:
        return False
    reader = GGUFIndex.open(gguf_path)
    names = [f"blk.0.{p}.weight" for parts in FUSED.values() for p in parts]
    try:
        return all(tensor_kind(reader, n) in FORMATS for n in names)
    except KeyError:
        return False


def quantize_q8act(model: LlamaModel, gguf_path: str | os.PathLike) -> int:
    """Replace `model`'s block-format linears and output head with `Q8ActWeight`s built from `gguf_path`, in
    place (a CPU model loaded from that file). Returns how many were replaced, the head included."""
    from verispec.kernels.cpu_kernels import load
    from verispec.models.decoder_kernel import DecoderKernel
    from verispec.kernels.q8act import Q8ActWeight

    reader = GGUFIndex.open(gguf_path)
    replaced = 0
    for i, layer in enumerate(model.layers):  # parts of mixed or non-block formats stay dense
        for fused, parts in _fused_tensors(reader, model, i, lambda kinds: len(kinds) == 1 and kinds <= set(FORMATS)):
            rows = []
            for name, h in parts:
                raw, kind, k = raw_rows(reader, name)
                rows.append((raw if h is None else raw[unpermute_rows(raw.shape[0], h)], kind))
            dense, packed = getattr(layer, fused), Q8ActWeight.stacked(rows, k)
            if packed.shape != tuple(dense.shape):
                raise ValueError(f"layer {i} {fused}: GGUF blocks {packed.shape} vs model {tuple(dense.shape)}")
            _swap(layer, fused, packed)
            replaced += 1
    head = "token_embd.weight" if model.lm_head is None else "output.weight"
    if tensor_kind(reader, head) in FORMATS:
        raw, kind, k = raw_rows(reader, head)
        model.head_weight = Q8ActWeight(raw, kind, raw.shape[0], k)
        replaced += 1
    model.attention_kernel = load().attention  # the path's attention and RoPE: verispec's fp32 kernels
    model.rope_kernel = load().rope
    model.batch_invariant = True  # every row computes alone in this kernel; attention follows suit
    model.decoder_kernel = DecoderKernel.build(model)  # all layers in one call where they are all covered
    return replaced
