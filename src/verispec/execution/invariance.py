"""Batch invariance of a loaded model's linear layers, measured on its own weights.

A token's logits may depend on how many other rows share its forward: a kernel can block, split or reorder its
reduction by M, and then a draft token verified in a block of 8, or beside another request, rounds differently
than the same token decoded alone. Where that happens, greedy speculative output equals plain output only up to
near-ties. This module checks, for one decoder layer's linears and the output head, whether each row of a
16-row product is bitwise the row computed alone, and the row inside blocks of 2, 4 and 8. The engine turns on
per-query attention (`LlamaModel.batch_invariant`) where the linears pass, so the whole forward is invariant.
Measured on this CPU with torch 2.13: dense bf16 and the int4 / int8 weight-only kernels pass; dense fp32 does
not (its GEMM rounds by M, up to 2e-5).
"""

from __future__ import annotations

import torch

from verispec.models.linear import Weight, linear
from verispec.models.llama import LlamaModel

ROWS = 16  # the largest block checked
BLOCKS = (1, 2, 4, 8, ROWS)


def model_linears(model: LlamaModel) -> list[tuple[str, Weight]]:
    """Layer 0's linears (dense tensors or kernel-path modules) and the output head, by name."""
    layer = model.layers[0]
    head = getattr(model, "head_weight", None)
    return [(n, getattr(layer, n)) for n in ("qkv", "o", "gate_up", "down")] + [
        ("head", head if head is not None else model.output_weight())]


def rows_invariant(w: Weight, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> bool:
    """Whether x [16, k] W^T's rows equal each row computed alone and in blocks of 2, 4, 8, bitwise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, k, generator=g).to(device=device, dtype=dtype)  # [16, k]
    with torch.inference_mode():
        full = linear(x, w, None)  # [16, N]
        for m in BLOCKS[:-1]:
            for i in range(0, ROWS, m):  # each block against its rows of the whole, one block alive at a time
                if not torch.equal(linear(x[i : i + m], w, None), full[i : i + m]):  # [m, N]
                    return False
    return True


def linears_row_invariant(model: LlamaModel) -> dict[str, bool]:
    """Linear name -> whether its rows are batch-invariant on this machine, for the model's own weights."""
    out = {}
    for name, w in model_linears(model):
        k = w.shape[1]
        out[name] = rows_invariant(w, k, model.dtype, model.device)
    return out
