"""Building verispec's CPU kernel (csrc/cpu.c) for the CPU at hand, and the C enums its callers pass.

`pip install` stays one command: nothing is compiled at install time. The first time the `gguf-q8act` path is
considered, the C source shipped in the package is compiled with the machine's C compiler (`$CC`, else cc, gcc or
clang) into the verispec cache, once per source, compiler, flags and CPU flags; later runs load the cached
library. The flags come from the CPU: `-mavx2 -mfma -mf16c` where it has all three (the AVX2 body), plus
`-mavx512f -mavx512bw -mavx512vl -mavx512vnni` where it has those too (the AVX-512 VNNI body, 16 outputs per vector
and vpdpbusd for the integer sums), none otherwise (only the portable body, which `dtype="auto"` never picks).
OpenMP is used where the compiler has it. Without a compiler the path is simply not offered, and why is said once
(KernelUnavailable).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from verispec.kernels.cpu import cpu_info

log = logging.getLogger(__name__)

SOURCE = "cpu.c"
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7, "IQ4_NL": 8,
         "IQ4_XS": 9}  # the C enum
AVX2_FLAGS = ("avx2", "fma", "f16c")
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
BODIES = {"portable": 1, "avx2": 2, "avx512-vnni": 3}  # the C enum VS_BODY_*; 0 = the active one


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded here (no compiler, a failed build): the reason is the message."""


def compiler() -> str | None:
    """The C compiler to build with: $CC, else the first of cc, gcc, clang on PATH."""
    env = os.environ.get("CC")
    if env:
        return env
    return next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def build_flags(avx512: bool = True) -> tuple[str, ...]:
    """-O3 and no contraction of a * b + c into fma beyond the source's own (so the bodies round alike), plus
    the vector flags this CPU has (the AVX-512 ones only with `avx512`)."""
    base = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno")
    has = set(cpu_info().flags)
    if not has.issuperset(AVX2_FLAGS):
        return base
    vec = ("-mavx2", "-mfma", "-mf16c")
    if avx512 and has.issuperset(AVX512_FLAGS):
        vec += ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
    return base + vec


def _source() -> bytes:
    return resources.files("verispec.kernels").joinpath("csrc", SOURCE).read_bytes()


def source_digest() -> str:
    """A short digest of the kernel source: what a cached measurement of it is valid for."""
    return hashlib.sha256(_source()).hexdigest()[:16]


def _build(cc: str, flags: tuple[str, ...], out: Path) -> bool:
    """Compile into `out` (atomically); returns whether OpenMP made it in. Raises KernelUnavailable."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / SOURCE
        src.write_bytes(_source())
        lib = Path(tmp) / out.name
        errors = ""
        for openmp in (("-fopenmp",), ()):
            cmd = [cc, *flags, *openmp, "-o", str(lib), str(src), "-lm"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if proc.returncode == 0:
                os.replace(lib, out)
                return bool(openmp)
            errors = proc.stderr.strip()[-800:]
        raise KernelUnavailable(f"{cc} could not build {SOURCE}: {errors}")


def cached_build(cc: str, version: str, flags: tuple[str, ...], cache: Path) -> Path:
    """The library built from this source with `cc` and `flags` for this CPU, from the cache or built now."""
    key = hashlib.sha256(b"|".join([_source(), cc.encode(), version.encode(), " ".join(flags).encode(),
                                    " ".join(cpu_info().flags).encode()])).hexdigest()[:16]
    out = cache / "kernels" / "build" / key / "libverispec_cpu.so"
    if not out.exists():
        log.info("building verispec's CPU kernel with %s %s", cc, " ".join(flags))
        try:
            if _build(cc, flags, out):
                out.with_suffix(".openmp").touch()
        except (OSError, subprocess.SubprocessError) as e:  # a read-only cache, a compiler that hangs
            raise KernelUnavailable(f"could not build {SOURCE} into {out.parent}: {e}") from e
    return out
