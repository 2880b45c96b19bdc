"""A kernel path: 4-bit weights (GGUF Q4_0 / Q4_1) multiplied by aten's CPU int4 kernel, without dequantising.

The kernel (`aten._weight_int4pack_mm_for_cpu`, group size 32) computes w = (q - 8) * scale + zero per 32-element
group along K, with scale and zero in the activation dtype. So Q4_0 (w = (q - 8) d) is scale = d, zero = 0, and
Q4_1 (w = q d + m) is scale = d, zero = m + 8 d (summed in float64, then cast once). With float32 activations the
weights are gguf's own fp32 dequantisation; with bfloat16 activations (the fast path) scale and zero are rounded
to bfloat16, and each row's result does not depend on the other rows of the batch. CPU only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

GROUP = 32  # elements of K per (scale, zero) pair: the GGUF block size
N_MULTIPLE = 16  # the CPU packing needs N divisible by this

ArrayLike = torch.Tensor | np.ndarray


def int4_kernel_available() -> bool:
    """Whether this torch build has the CPU int4 pack and matmul ops."""
    ops = torch.ops.aten
    return hasattr(ops, "_convert_weight_to_int4pack_for_cpu") and hasattr(ops, "_weight_int4pack_mm_for_cpu")


def q4_affine(q: ArrayLike, d: ArrayLike, m: ArrayLike | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 (m None) or Q4_1 weight -> (q int32 [N, K], scale float64 [N, K/32], zero float64 [N, K/32])
    with w = (q - 8) * scale + zero."""
    q32 = torch.as_tensor(q).to(torch.int32)  # [N, K]
    scale = torch.as_tensor(d).to(torch.float64)  # [N, K/32]
    zero = torch.zeros_like(scale) if m is None else torch.as_tensor(m).to(torch.float64) + 8 * scale
    return q32, scale, zero


class Int4Weight(nn.Module):
    """A [N, K] weight packed for the CPU int4 kernel: `matmul(x [M, K]) -> [M, N]` in the activation dtype.

    An `nn.Module` (buffers `packed`, `scale_zero`), so it can stand where a layer had a weight parameter and
    moves with the model; `dtype` is the activation dtype the scales are stored in.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        """q: int [N, K] in 0..15; scale, zero: float [N, K/32]; w = (q - 8) * scale + zero."""
        super().__init__()
        if not int4_kernel_available():
            raise RuntimeError(f"torch {torch.__version__} has no CPU int4 kernel (_weight_int4pack_mm_for_cpu)")
        n, k = q.shape
        if k % GROUP or n % N_MULTIPLE:
            raise ValueError(f"int4 weight [{n}, {k}]: K must be a multiple of {GROUP} and N of {N_MULTIPLE}")
        if scale.shape != (n, k // GROUP) or zero.shape != scale.shape:
            raise ValueError(f"scale / zero must be [{n}, {k // GROUP}], got {tuple(scale.shape)}, {tuple(zero.shape)}")
        if q.is_cuda or int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError("q must be a CPU tensor of values in 0..15")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)  # [N, K/2]
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", torch.stack([scale.T, zero.T], -1).to(dtype).contiguous())  # [K/32, N, 2]

    @classmethod
    def from_q4(cls, parts: Sequence[tuple[ArrayLike, ArrayLike, ArrayLike | None]],
                dtype: torch.dtype = torch.bfloat16) -> Int4Weight:
        """Q4_0 / Q4_1 weights (q [N_i, K], d [N_i, K/32], m [N_i, K/32] or None) stacked along N, e.g. q, k, v."""
        affine = [q4_affine(*p) for p in parts]
        return cls(*(torch.cat([a[i] for a in affine]) for i in range(3)), dtype=dtype)  # type: ignore[arg-type]

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale_zero.shape[1], self.packed.shape[1] * 2

    @property
    def dtype(self) -> torch.dtype:
        return self.scale_zero.dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] -> [M, N] in the activation dtype (x is cast to it)."""
        if x.device.type != "cpu" or self.packed.device.type != "cpu":
            raise NotImplementedError("Int4Weight runs aten's CPU int4 kernel only; CUDA needs another packing")
        if x.dim() != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"int4 matmul: x {tuple(x.shape)} does not match the weight {self.shape}")
        x = x.to(self.dtype).contiguous()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zero)  # [M, N]

    forward = matmul

    def dequantized(self) -> torch.Tensor:
        """[N, K] float32: the weights this matmul uses (its scales as stored), from the kernel on an identity."""
        eye = torch.eye(self.shape[1], dtype=torch.float32)  # [K, K]
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scale_zero.float())  # [K, N]
        return w_t.T.contiguous()

    def extra_repr(self) -> str:
        return f"shape={self.shape}, dtype={self.dtype}, group={GROUP}"
