"""Weight paths (how the target's linears are stored and multiplied) and the hardware they run on.

A path is a frozen (name, dtype, quantization) triple: `fp32` and `bf16` are dense weights, `fp16` dense half
precision (CUDA), `gguf-int4` the GGUF's own Q4_0 / Q4_1 blocks on aten's CPU int4 kernel with bf16 activations,
`gguf-q8act` the GGUF's own blocks (and its Q8_0 head) on verispec's CPU kernel with activations quantised to int8
per 32 values, llama.cpp's CPU arithmetic (kernels/q8act.py).
`candidates` lists the paths a model can run on a device; `execution/autotune.py` measures them and picks one.
The CPU's model and flags are in kernels/cpu.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightPath:
    name: str  # "fp32" | "bf16" | "fp16" | "gguf-int4" | "gguf-q8act"
    dtype: str  # activation (and dense weight) dtype
    quantization: str | None  # load_model's quantization argument
    note: str  # one line for people

    def as_dict(self) -> dict[str, str | None]:
        return {"path": self.name, "dtype": self.dtype, "quantization": self.quantization}


PATHS: dict[str, WeightPath] = {
    "fp32": WeightPath("fp32", "float32", None, "dense float32 weights and activations"),
    "bf16": WeightPath("bf16", "bfloat16", None, "dense bfloat16 weights and activations"),
    "fp16": WeightPath("fp16", "float16", None, "dense float16 weights and activations"),
    "gguf-int4": WeightPath("gguf-int4", "bfloat16", "gguf",
                            "the GGUF's own Q4 blocks on aten's CPU int4 kernel, bfloat16 activations"),
    "gguf-q8act": WeightPath("gguf-q8act", "float32", "gguf-q8act",
                             "the GGUF's own blocks and head on verispec's CPU kernel, activations rounded to int8 "
                             "per 32 values (llama.cpp's rounding for 32-blocks, finer than its per 256 for "
                             "K-quants)"),
}
DTYPE_PATHS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def path_for(dtype: str, quantization: str | None) -> WeightPath:
    """The path an explicit (dtype, quantization) pair names."""
    if quantization == "gguf":
        return PATHS["gguf-int4"]
    if quantization == "gguf-q8act":
        return PATHS["gguf-q8act"]
    if dtype not in DTYPE_PATHS:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return PATHS[DTYPE_PATHS[dtype]]


def candidates(device: str, gguf_int4: bool, gguf_blocks: bool | Mapping[str, str] | None = None
               ) -> list[WeightPath]:
    """The paths `dtype="auto"` chooses among. CUDA: bf16 only (its tensor cores; nothing to measure). CPU: dense
    fp32 and bf16, plus gguf-int4 when the checkpoint is a GGUF whose linears are Q4_0 / Q4_1 (`gguf_int4`, if this
    torch has the int4 kernel) and gguf-q8act when its linears are in formats verispec's kernel runs natively
    (`gguf_blocks`, default `gguf_int4`; models/quantized.py's `gguf_block_linears`), if that kernel builds here
    with its AVX2 body. Paths that change the model (quantising a dense checkpoint) are never chosen for you."""
    if torch.device(device).type != "cpu":
        return [PATHS["bf16"]]
    from verispec.kernels.int4 import int4_kernel_available

    out = [PATHS["fp32"], PATHS["bf16"]]
    if gguf_int4 and int4_kernel_available():
        out.append(PATHS["gguf-int4"])
    if gguf_int4 if gguf_blocks is None else bool(gguf_blocks):
        from verispec.kernels.cpu_kernels import fast_kernel_available

        ok, why = fast_kernel_available()
        if ok:
            out.append(PATHS["gguf-q8act"])
        else:
            log.info("path gguf-q8act not offered: %s", why)
    return out
