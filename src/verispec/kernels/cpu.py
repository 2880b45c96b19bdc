"""The CPU a path runs on: what every stats dict, report and /metrics label says about it (its model name, the
instruction-set flags that decide which kernels are fast: AVX2, AVX-512, AVX-512-bf16, AMX, and the capability
torch's own kernels were dispatched for), and what verispec's own kernels are built for (kernels/cpu_build.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# the flags that change which kernel is fastest: int8 / bf16 dot products and matrix tiles
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
                "amx_tile", "amx_bf16", "amx_int8")


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


def machine_busy() -> bool:
    """Whether other processes already load the CPU (1-minute load average above the core count): a profile
    measured then says more about them than about the kernels, so it is used for this run but not cached."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1) + 0.5
    except (AttributeError, OSError):
        return False


def memory_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (/proc/meminfo's MemAvailable), or None where it
    does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library, or none found)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc). Loading frees large scratch (a layer's file bytes and
    decoding intermediates, the tokenizer's parsed JSON, the invariance check's products), which glibc keeps in
    the heap once its mmap threshold has grown past their size: without a trim the next step's memory comes on top
    of them and the process's peak RSS carries them (docs/results/shapes.md)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
