"""GGUF-quantised decoders: linears replaced by kernel modules built from the file's own blocks (no
requantisation). "gguf" swaps them into the dense decoder loaded first; "gguf-q8act" installs them straight into
a decoder built on the meta device (models/gguf_direct.py, through `q8act_weight` and `finish_q8act` here), so no
dense copy of the model is ever held; `quantize_q8act` swaps them into a dense-loaded model where that light load
cannot cover the file (and is the reference its tests compare with).
- `quantization="gguf"` (`quantize_from_gguf`, bf16): every linear whose GGUF tensors are all Q4_0 / Q4_1 becomes
  an `Int4Weight` (kernels/int4.py: aten's CPU int4 kernel, bf16 activations). The head stays dense.
- `quantization="gguf-q8act"` (`quantize_q8act`, fp32 activations): every linear whose GGUF tensors are in the
  kernel's formats (Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K / IQ4_NL / IQ4_XS, any mix: each part of
  a fused weight runs on its own format) becomes a `Q8ActWeight` (kernels/q8act.py: verispec's kernel, int8
  activations per 32), and so does the output head (the tied embedding's blocks, or `output.weight`); attention
  runs on verispec's fp32 CPU kernel (`Library.attention`).
Fused weights stack their parts along N as the HF loader does (qkv = q, k, v; gate_up = gate, up). llama.cpp
stores a "llama" model's q and k rows permuted for its RoPE layout; they are un-permuted here exactly as
transformers' GGUF loader does, so row i of every weight is the dense model's row i. Norms and biases stay dense,
the embedding too after a dense load (the light load keeps it in the file's format, models/gguf_embedding.py); a
linear in any other format (F16, Q2_K, Q3_K, IQ2_*, IQ3_*, ...) stays dense too, and says so on
stderr with its expected cost (`dense_fallbacks`).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, Iterator

import numpy as np
from torch import nn

from verispec.kernels.int4 import GROUP, N_MULTIPLE, Int4Weight
from verispec.models.gguf_blocks import KERNEL_FORMATS, Blocks, bits_per_weight, raw_rows, read_blocks, tensor_kind
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


def gguf_block_linears(gguf_path: str | os.PathLike | None) -> dict[str, str]:
    """Where a GGUF's first layer's linears are all in formats verispec's kernel runs natively (any mix of them,
    each tensor on its own format): each fused linear's format (its first part's) and the head's, {"qkv": "Q4_K",
    ..., "head": "Q6_K"}, which dtype="auto" profiles the gguf-q8act path in; else {} (the path is not offered)."""
    if gguf_path is None:
        return {}
    reader = GGUFIndex.open(gguf_path)
    report_fallbacks(str(gguf_path))
    try:
        kinds = {f: [tensor_kind(reader, f"blk.0.{p}.weight") for p in parts] for f, parts in FUSED.items()}
        head = "output.weight" if "output.weight" in reader.tensors else "token_embd.weight"
        head_kind = tensor_kind(reader, head)
    except KeyError:
        return {}
    if not all(k in KERNEL_FORMATS for ks in kinds.values() for k in ks):
        return {}
    return {**{f: ks[0] for f, ks in kinds.items()}, "head": head_kind if head_kind in KERNEL_FORMATS else "Q8_0"}


DENSE_FORMATS = ("F32", "F16", "BF16")  # dense in the file already: nothing is lost by running them dense


def linear_formats(gguf_path: str | os.PathLike) -> dict[str, int]:
    """GGML type of the file's linear and head weights -> how many tensors (what `verispec doctor` reports)."""
    reader = GGUFIndex.open(gguf_path)
    linear = {f"{p}.weight" for parts in FUSED.values() for p in parts}
    head = "output.weight" if "output.weight" in reader.tensors else "token_embd.weight"  # tied: the embedding
    out: dict[str, int] = {}
    for name, e in reader.tensors.items():
        if name.split(".", 2)[-1] in linear or name == head:
            out[e.kind] = out.get(e.kind, 0) + 1
    return out


def dense_fallbacks(gguf_path: str | os.PathLike) -> dict[str, int]:
    """Quantised formats of the file's linear and head weights that verispec's kernel has no body for -> how many
    tensors: those run dense (bf16 under dtype auto) instead of on their blocks."""
    return {k: n for k, n in linear_formats(gguf_path).items() if k not in KERNEL_FORMATS and k not in DENSE_FORMATS}


def fallback_note(fallbacks: dict[str, int]) -> str:
    """One line for people: which formats fall back to dense bf16 and what that costs in bytes read per token."""
    costs = ", ".join(f"{n} {k} tensor{'s' if n > 1 else ''} ({bits_per_weight(k):.2f} bits/weight: dense bf16 "
                      f"reads x{16 / bits_per_weight(k):.1f} the bytes)" for k, n in sorted(fallbacks.items()))
    return (f"no native CPU kernel body for {costs}; they run dense, and a model whose layers are not all native "
            f"runs wholly on dense bf16: expect decode several times slower than on Q4_K / Q6_K / Q8_0 blocks")


@functools.cache
def report_fallbacks(gguf_path: str) -> None:
    """Say once per file on stderr which of its quantised formats fall back to dense (`fallback_note`)."""
    try:
        found = dense_fallbacks(gguf_path)
    except (OSError, ValueError, KeyError):
        return
    if found:
        print(f"verispec: {os.path.basename(gguf_path)}: {fallback_note(found)}", file=sys.stderr, flush=True)


def quantize_q8act(model: LlamaModel, gguf_path: str | os.PathLike) -> int:
    """Replace `model`'s block-format linears and output head with `Q8ActWeight`s built from `gguf_path`, in
    place (a CPU model loaded from that file). Returns how many were replaced, the head included. Each part of a
    fused weight keeps its own format (a Q4_K_M's v rows may be Q6_K beside Q4_K q and k rows)."""
    reader = GGUFIndex.open(gguf_path)
    replaced = 0
    report_fallbacks(str(gguf_path))
    for i, layer in enumerate(model.layers):  # a fused weight with a part in another format stays dense
        for fused, parts in _fused_tensors(reader, model, i, lambda kinds: kinds <= set(KERNEL_FORMATS)):
            dense, packed = getattr(layer, fused), q8act_weight(reader, parts)
            if packed.shape != tuple(dense.shape):
                raise ValueError(f"layer {i} {fused}: GGUF blocks {packed.shape} vs model {tuple(dense.shape)}")
            _swap(layer, fused, packed)
            replaced += 1
    head = "token_embd.weight" if model.lm_head is None else "output.weight"
    if tensor_kind(reader, head) in KERNEL_FORMATS:
        model.head_weight = q8act_head(reader, head)
        replaced += 1
    finish_q8act(model)
    return replaced


def q8act_weight(reader: GGUFIndex, parts: list[tuple[str, int | None]]) -> nn.Module:
    """One fused weight's `Q8ActWeight` from its parts (`_fused_tensors`: tensor name, heads to un-permute by),
    each read from the file into memory of its own, re-ordered where permuted, repacked, and dropped."""
    from verispec.kernels.q8act import Q8ActWeight

    rows = []
    for name, h in parts:
        raw, kind, k = raw_rows(reader, name)
        rows.append((raw if h is None else raw[unpermute_rows(raw.shape[0], h)], kind))
    return Q8ActWeight.stacked(rows, k)


def q8act_head(reader: GGUFIndex, name: str) -> nn.Module:
    """The output head's `Q8ActWeight` from tensor `name` ([V, d] in a kernel format), repacked from the file some
    rows at a time: a 150k-row head's raw bytes and its tiles are never both whole in memory."""
    from verispec.kernels.q8act import Q8ActWeight

    e = reader.entry(name)
    rows = reader.row_source(name)
    return Q8ActWeight(rows, e.kind, rows.shape[0], int(e.shape[0]))


def finish_q8act(model: LlamaModel) -> None:
    """The gguf-q8act path's runtime settings once its weights are in: verispec's fp32 attention and RoPE kernels,
    batch invariance, and the one-call decoder where every layer is covered."""
    from verispec.kernels.cpu_kernels import load
    from verispec.models.decoder_kernel import DecoderKernel

    model.attention_kernel = load().attention  # the path's attention and RoPE: verispec's fp32 kernels
    model.rope_kernel = load().rope
    model.batch_invariant = True  # every row computes alone in this kernel; attention follows suit
    model.decoder_kernel = DecoderKernel.build(model)  # all layers in one call where they are all covered
