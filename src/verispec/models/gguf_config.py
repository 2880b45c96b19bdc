"""What transformers' GGUF reader leaves out of a Llama-family GGUF's config, read back from the file's tensors.

- head_dim: a model whose heads are not hidden_size / heads wide (Qwen3, Llama-3.2-1B's 64 with 32 heads of a
  2048 model is the plain case) says it through its q projection's rows; the reader keeps no `key_length` for
  llama, qwen2 or qwen3.
- Llama-3's `llama3` RoPE scaling: llama.cpp's converter stores it as the `rope_freqs` tensor (one divisor per
  frequency), not as metadata, and the reader drops that tensor, so a Llama-3.x GGUF would run with unscaled
  RoPE. The four parameters are recovered from the divisors (exactly where the file came from a llama3 config:
  checked by recomputing every divisor) and written as the HF `rope_scaling` other tools read.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np


def complete_config(gguf_path: str | Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` (transformers' config dict of the GGUF) with head_dim and llama3 rope_scaling filled in from the
    file's tensors where they say more than the metadata."""
    from verispec.models.gguf_index import GGUFIndex

    index = GGUFIndex.open(gguf_path)
    out = dict(cfg)
    heads = cfg.get("num_attention_heads")
    q = index.tensors.get("blk.0.attn_q.weight")
    dim = cfg["hidden_size"] // heads if heads else None
    if q is not None and heads:
        dim = int(q.shape[1]) // heads  # GGUF shapes list the input dimension first
        out["head_dim"] = dim  # always: Qwen3's config class defaults to 128 where it is not given
    freqs = index.tensors.get("rope_freqs.weight")
    if freqs is not None and not cfg.get("rope_scaling") and dim:
        if freqs.kind != "F32":
            raise ValueError(f"{gguf_path}: rope_freqs is {freqs.kind}, expected F32")
        factors = np.frombuffer(np.asarray(index.data("rope_freqs.weight")).tobytes(), dtype=np.float32)
        theta = float(cfg.get("rope_theta", 10000.0))
        params = llama3_from_factors(factors, theta, dim, gguf_path)
        if params["rope_type"] != "default":
            out["rope_scaling"] = {**params, "rope_theta": theta}
    return out


def llama3_from_factors(factors: np.ndarray, theta: float, dim: int, where: Any = "") -> dict[str, Any]:
    """The llama3 RoPE parameters whose per-frequency divisors are `factors` (dim / 2 of them): `factor` is the
    largest divisor; between the wavelength bounds the blend s = (old / wavelen - low) / (high - low) is linear in
    1 / wavelen, so two or more blended divisors give old / (high - low) and low / (high - low); low_freq_factor
    is taken as 1 (the bounds old / high and old / low are all the divisors determine). ValueError where the
    divisors are not of that form."""
    f = np.asarray(factors, dtype=np.float64)
    if f.shape != (dim // 2,):
        raise ValueError(f"{where}: rope_freqs has {f.size} values, expected {dim // 2} (head_dim {dim})")
    if np.allclose(f, 1.0):
        return {"rope_type": "default"}
    factor = float(f.max())
    inv_wavelen = 1.0 / (2 * math.pi / (1.0 / theta ** (np.arange(0, dim, 2) / dim)))
    blended = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if blended.sum() < 2:
        raise ValueError(f"{where}: rope_freqs has {int(blended.sum())} blended frequencies; cannot recover "
                         "llama3 RoPE scaling from it")
    s = (1 / f[blended] - 1 / factor) / (1 - 1 / factor)  # 1 / f = (1 - s) / factor + s
    a, b = np.polyfit(inv_wavelen[blended], s, 1)  # s = a / wavelen + b, a = old / (high - low), b = -low / (h - l)
    low = 1.0
    high = low - low / b
    old = a * (high - low)
    params = {"rope_type": "llama3", "factor": _round(factor), "low_freq_factor": low,
              "high_freq_factor": _round(high), "original_max_position_embeddings": int(round(old))}
    check = _divisors(params, theta, dim)
    if not np.allclose(check, f, rtol=1e-4, atol=1e-6):
        raise ValueError(f"{where}: rope_freqs is not a llama3 RoPE scaling (recovered {params}, max divisor error "
                         f"{np.abs(check - f).max():.3g})")
    return params


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def _divisors(p: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2) / dim)
    old, low, high, factor = (p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"],
                              p["factor"])
    smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor,
                                                        1 / ((1 - smooth) / factor + smooth)))
