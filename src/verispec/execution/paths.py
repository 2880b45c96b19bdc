"""Weight paths (how the target's linears are stored and multiplied) and the hardware they run on.

A path is a frozen (name, dtype, quantization) triple: `fp32` and `bf16` are dense weights, `fp16` dense half
precision (CUDA), `gguf-int4` the GGUF's own Q4_0 / Q4_1 blocks on aten's CPU int4 kernel with bf16 activations.
`candidates` lists the paths a model can run on a device; `execution/autotune.py` measures them and picks one.
`cpu_info` is what every stats dict, report and /metrics label says about the CPU: its model name, the
instruction-set flags that decide which kernels are fast (AVX2, AVX-512, AVX-512-bf16, AMX), and the
capability torch's own kernels were dispatched for.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# the flags that change which kernel is fastest: int8 / bf16 dot products and matrix tiles
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni",
                "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class WeightPath:
    name: str  # "fp32" | "bf16" | "fp16" | "gguf-int4"
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
}
DTYPE_PATHS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def path_for(dtype: str, quantization: str | None) -> WeightPath:
    """The path an explicit (dtype, quantization) pair names."""
    if quantization == "gguf":
        return PATHS["gguf-int4"]
    if dtype not in DTYPE_PATHS:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return PATHS[DTYPE_PATHS[dtype]]


def candidates(device: str, gguf_int4: bool) -> list[WeightPath]:
    """The paths `dtype="auto"` chooses among. CUDA: bf16 only (its tensor cores; nothing to measure). CPU: dense
    fp32 and bf16, plus gguf-int4 when the checkpoint is a GGUF whose linears are Q4_0 / Q4_1 and this torch has
    the int4 kernel. Paths that change the model (quantising a dense checkpoint) are never chosen for you."""
    if torch.device(device).type != "cpu":
        return [PATHS["bf16"]]
    from verispec.execution.int4 import int4_kernel_available

    out = [PATHS["fp32"], PATHS["bf16"]]
    if gguf_int4 and int4_kernel_available():
        out.append(PATHS["gguf-int4"])
    return out


@dataclass(frozen=True)
class CpuInfo:
    model: str  # e.g. "AMD EPYC 7B13"
    flags: tuple[str, ...]  # the KERNEL_FLAGS this CPU has
    capability: str  # torch's dispatch level: "DEFAULT", "AVX2", "AVX512", ...

    def label(self) -> str:
        """One short line: 'AVX2 [avx2 fma f16c] AMD EPYC 7B13'."""
        return f"{self.capability} [{' '.join(self.flags) or 'no vector flags'}] {self.model}".strip()

    def as_dict(self) -> dict[str, str]:
        return {"cpu": self.model, "cpu_flags": " ".join(self.flags), "cpu_capability": self.capability}


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU, from /proc/cpuinfo where there is one (Linux), else what `platform` knows."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags |= set(value.split())
    capability = torch.backends.cpu.get_cpu_capability()
    return CpuInfo(model, tuple(f for f in KERNEL_FLAGS if f in flags), capability)
