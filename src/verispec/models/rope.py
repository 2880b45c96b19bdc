"""Rotary position embedding tables for the RoPE variants Llama-family configs use."""

from __future__ import annotations

import math

import torch

from verispec.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """inv_freq: [head_dim / 2], float32, for rope_type default | linear | llama3."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_type == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        low_wavelen = cfg.rope_original_max_positions / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_max_positions / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = (cfg.rope_original_max_positions / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_tables(cfg: ModelConfig, max_len: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: [max_len, head_dim] float32, in the half-split layout of HF's rotate_half.

    The sine table carries rotate_half's sign: [-sin, sin], so that rotate_half(x) * sin == roll(x) * signed_sin.
    """
    inv = inverse_frequencies(cfg).to(device)
    t = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)  # [max_len, head_dim/2]
    half = freqs.shape[1]
    # written into the tables' own halves: the one temporary is `freqs` (a 32k-position table of a 1.5B model
    # is 17 MB each, and building it through cat held three more such temporaries at the load's peak)
    cos = torch.empty(max_len, 2 * half, device=device)  # [max_len, head_dim]
    sin = torch.empty(max_len, 2 * half, device=device)
    torch.cos(freqs, out=cos[:, :half])
    cos[:, half:] = cos[:, :half]
    torch.sin(freqs, out=sin[:, half:])
    torch.neg(sin[:, half:], out=sin[:, :half])
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, head_dim]; cos, signed_sin: [n, 1, head_dim] in x's dtype. Three ops, no temporaries."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
