"""The linear-layer and RMSNorm arithmetic of models/llama.py's decoder: a layer's weight is a dense tensor or a
kernel-path module (kernels/int4.py's `Int4Weight`, kernels/q8act.py's `Q8ActWeight`, put there by
models/quantized.py) that multiplies itself; a kernel module that takes the input's RMSNorm or the residual into its
call (`fuses_norm`) gets them, with its own arithmetic for those.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., d], w: [d] -> [..., d]. HF's arithmetic: normalise in fp32, round to x's dtype, then scale."""
    xf = x.float()  # [..., d]
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):  # drafters train through it
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # The same arithmetic in fewer, cheaper ops (this runs twice per layer per forward): x*x is pow(x, 2), mean is
    # sum / d, eps + sum / d is one addcdiv (the same two roundings), in-place where the tensor is ours, and the
    # scalars as cached fp32 tensors (a Python number makes an op convert a wrapped scalar first).
    ss = (xf * xf).sum(-1, keepdim=True)  # [..., 1]
    r = torch.addcdiv(_fp32_scalar(eps, x.device), ss, _fp32_scalar(x.shape[-1], x.device)).rsqrt_()
    y = (xf * r if xf is x else xf.mul_(r)).to(x.dtype)  # normalised, rounded to x's dtype
    return y.mul_(w) if w.dtype == y.dtype else w * y


@functools.lru_cache(maxsize=None)
def _fp32_scalar(value: float, device: torch.device) -> torch.Tensor:
    """A 0-dim fp32 tensor holding `value`: the operand an op would otherwise build from a Python number."""
    return torch.tensor(float(value), dtype=torch.float32, device=device)


# A layer's weight is a tensor [out, in] (the default) or a kernel-path module (e.g. kernels/int4.py's
# `Int4Weight`, put there by models/quantized.py) that multiplies itself: w(h [N, in]) -> [N, out].
Weight = torch.Tensor | nn.Module


def linear(h: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    """h: [N, in] -> h W^T (+ b): [N, out]. A kernel module's `forward` is called directly: no hooks to run."""
    if isinstance(w, torch.Tensor):
        return F.linear(h, w, b)
    y = w.forward(h)  # [N, out], a new tensor
    return y if b is None else (y.add_(b) if y.dtype == b.dtype else y + b)


def fuses(w: Weight) -> bool:
    """Whether w is a kernel module that takes the input's RMSNorm and the residual into its call."""
    return not isinstance(w, torch.Tensor) and getattr(type(w), "fuses_norm", False)


def norm_linear(x: torch.Tensor, norm: torch.Tensor, eps: float, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    """rms_norm(x: [N, in]) W^T (+ b): [N, out]. A kernel module that normalises as it reads its input (execution/
    q8act.py, fp32) does both in one call, with its own arithmetic for the norm."""
    if b is None and fuses(w) and x.dtype is torch.float32 and norm.dtype is torch.float32:
        return w.matmul(x, norm=norm, eps=eps)  # type: ignore[operator]
    return linear(rms_norm(x, norm, eps), w, b)


def residual_linear(x: torch.Tensor, h: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    """x: [N, out] + h: [N, in] W^T (+ b), in one addmm when W is a tensor and there is no bias (or one kernel call
    that adds the residual as it writes, for a kernel module that does). A float32 residual over a lower-precision
    product (a bf16 drafter's correction of float32 logits) is added after it, in float32."""
    if b is None and isinstance(w, torch.Tensor) and x.dtype == h.dtype == w.dtype:
        return torch.addmm(x, h, w.t())
    if b is None and fuses(w) and x.dtype is torch.float32 and h.dtype is torch.float32:
        return w.matmul(h, residual=x)  # type: ignore[operator]
    y = linear(h, w, b)  # a new tensor: add the residual in place (x + y == y + x)
    return y.add_(x) if y.dtype == x.dtype else x + y
