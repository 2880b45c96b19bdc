"""verispec's own CPU kernels (csrc/cpu.c), built at first use for the CPU at hand and loaded with ctypes: the
GGUF-block matmul with int8 activations (execution/q8act.py) and fp32 attention of a few query rows
(`Library.attention`) and RoPE in place (`Library.rope`), the gguf-q8act path's attention; and `vs_decoder`, all
of a forward's decoder layers in one call (execution/decoder_kernel.py).

`pip install` stays one command: nothing is compiled at install time. The first time the `gguf-q8act` path is
considered, the C source shipped in the package is compiled with the machine's C compiler (`$CC`, else cc, gcc or
clang) into the verispec cache, once per source, compiler, flags and CPU flags; later runs load the cached
library. The flags come from the CPU: `-mavx2 -mfma -mf16c` where it has all three (the AVX2 body), plus
`-mavx512f -mavx512bw -mavx512vl -mavx512vnni` where it has those too (the AVX-512 VNNI body, 16 outputs per vector
and vpdpbusd for the integer sums), none otherwise (only the portable body, which `dtype="auto"` never picks).
Every body computes the same bits (the tests hold each to the portable one), so which one runs is a question of
speed only: at load the vector bodies built here are timed on the default model's layer shapes at one and eight
rows, the faster runs (`Library.body`, `Library.choice` says why), and every report says which. The AVX-512 body's
weight streams for 4 rows and more are fetched ahead into L1, L2 or non-temporally, whichever is faster on the linears
of one forward streamed from memory, measured once per machine and kept (`Library.prefetch`, `choose_prefetch`);
the streams of fewer rows (both vector bodies) into L1 or non-temporally, whichever makes a one-row forward and the
small work after it faster (`Library.row_prefetch`, `choose_row_prefetch`): no bit changes. OpenMP is used
where the compiler has it; torch's own OpenMP runtime, already loaded, serves the library, so its threads are
torch's threads. Without a compiler the path is simply not offered, and why is said once.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from verispec.execution.cpu import cpu_info, machine_busy

log = logging.getLogger(__name__)

SOURCE = "cpu.c"
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the C enum
AVX2_FLAGS = ("avx2", "fma", "f16c")
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
BODIES = {"portable": 1, "avx2": 2, "avx512-vnni": 3}  # the C enum VS_BODY_*; 0 = the active one
BODY_ENV = "VERISPEC_CPU_BODY"  # names the body to run instead of timing them
BODY_NAMES = {"portable": "portable C", "avx2": "AVX2+FMA+F16C", "avx512-vnni": "AVX-512 VNNI"}
# where the AVX-512 body's pair streams (4 rows and more) are fetched ahead to (vs_set_prefetch)
PREFETCH_LEVELS = ("l1", "l2", "nta")
PREFETCH_CODES = {"l1": 0, "l2": 1, "nta": 2}
PREFETCH_ENV = "VERISPEC_CPU_PREFETCH"  # names the level instead of timing the levels
# where the vector bodies' single-tile streams (fewer rows) are fetched ahead to (vs_set_row_prefetch)
ROW_PREFETCH_LEVELS = ("l1", "nta")
ROW_PREFETCH_ENV = "VERISPEC_CPU_ROW_PREFETCH"  # names the level instead of timing the levels


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded here (no compiler, a failed build): the reason is the message."""


@dataclass(frozen=True)
class Library:
    lib: ctypes.CDLL
    path: Path
    flags: tuple[str, ...]  # the compiler flags it was built with
    openmp: bool
    bodies: tuple[str, ...] = ("portable",)  # the matmul bodies built in (BODIES' names)
    body: str = "portable"  # the one that runs (vs_set_body), the fastest measured at load
    choice: str = ""  # why: the timings that chose it
    prefetch: str = "l1"  # where the AVX-512 body's pair streams are fetched ahead to, the fastest measured at load
    prefetch_choice: str = ""  # why (empty where the AVX-512 body does not run)
    row_prefetch: str = "l1"  # where the single-tile streams of fewer rows are fetched ahead to, measured at load
    row_prefetch_choice: str = ""  # why (empty where no vector body runs)

    @property
    def avx2(self) -> bool:
        """Whether the AVX2 body is in it (every vector build has it)."""
        return "avx2" in self.bodies

    def _code(self, body: str) -> int:
        """The C enum of one of `bodies`; ValueError for another name."""
        if body not in self.bodies:
            raise ValueError(f"matmul body {body!r} is not in this build (built: {', '.join(self.bodies)})")
        return BODIES[body]

    def describe(self) -> str:
        prefetch = (f", from 4 rows on weights fetched ahead into {self.prefetch.upper()} ({self.prefetch_choice})"
                    if self.prefetch_choice else "")
        if self.row_prefetch_choice:
            rows = "below 4 rows" if self.body == "avx512-vnni" else "weights fetched ahead"
            prefetch += (f", {rows} {'non-temporally' if self.row_prefetch == 'nta' else 'into L1'} "
                         f"({self.row_prefetch_choice})")
        return (f"{BODY_NAMES[self.body]} body{f' ({self.choice})' if self.choice else ''}{prefetch}, "
                f"{'OpenMP' if self.openmp else 'one thread'}, built with {' '.join(self.flags)}")

    def linear(self, packed: torch.Tensor, kind: str, n: int, k: int, x: torch.Tensor, out: torch.Tensor,
               reference: bool = False, norm: torch.Tensor | None = None, eps: float = 0.0,
               residual: torch.Tensor | None = None, swiglu: bool = False, body: str | None = None) -> None:
        """out [M, N] = x' [M, K] times the packed [N, K] weight's transpose (execution/q8act.py's layout), plus
        `residual` (float32 [M, N]) when given; x' = x, or RMSNorm(x) * norm (float32 [K]) with `eps` when `norm`
        is given, or silu(gate) * up of a float32 x = [gate | up] ([M, 2K]) when `swiglu`. x and out: contiguous
        CPU float32 or bfloat16. `body`: one of `bodies` (default: the active one); `reference`: the portable."""
        code = self._code("portable") if reference else self._code(body) if body is not None else 0
        rc = self.lib.vs_linear(packed.data_ptr(), KINDS[kind], n, k, x.data_ptr(), x.dtype == torch.bfloat16,
                                x.shape[0], out.data_ptr(), out.dtype == torch.bfloat16, torch.get_num_threads(),
                                code, None if norm is None else norm.data_ptr(), eps,
                                None if residual is None else residual.data_ptr(), swiglu)
        if rc:
            raise RuntimeError(f"vs_linear failed ({'bad shape, kind or residual' if rc == -1 else 'out of memory'})")

    @contextlib.contextmanager
    def running(self, body: str) -> Iterator[None]:
        """Inside the block, calls that name no body (and `vs_decoder`'s) run `body`; after it, `self.body` again.
        For benchmarks that compare bodies side by side (the bits are the same in each)."""
        self.lib.vs_set_body(self._code(body))
        try:
            yield
        finally:
            self.lib.vs_set_body(BODIES[self.body])

    @contextlib.contextmanager
    def attending_rows(self, rows: int) -> Iterator[None]:
        """Inside the block `vs_decoder`'s attention takes at most `rows` rows of one sequence per task (1: each row
        reads its keys alone; the default is 64, the most a task holds). For benchmarks that compare the grouping
        side by side (the bits are the same in each)."""
        was = self.lib.vs_set_attention_rows(rows)
        try:
            yield
        finally:
            self.lib.vs_set_attention_rows(was)

    @contextlib.contextmanager
    def prefetching(self, level: str) -> Iterator[None]:
        """Inside the block the AVX-512 body's pair streams are fetched ahead to `level` ("l1", "l2" or "nta":
        non-temporally); after it, `self.prefetch` again. For benchmarks that compare them side by side (the bits
        are the same in each)."""
        if level not in PREFETCH_LEVELS:
            raise ValueError(f"prefetch level {level!r} is not one of {', '.join(PREFETCH_LEVELS)}")
        self.lib.vs_set_prefetch(PREFETCH_CODES[level])
        try:
            yield
        finally:
            self.lib.vs_set_prefetch(PREFETCH_CODES[self.prefetch])

    @contextlib.contextmanager
    def row_prefetching(self, level: str) -> Iterator[None]:
        """Inside the block the single-tile weight streams (fewer rows than a pair takes) are fetched ahead to
        `level` ("l1" or "nta"); after it, `self.row_prefetch` again. For benchmarks (the bits are the same)."""
        if level not in ROW_PREFETCH_LEVELS:
            raise ValueError(f"row prefetch level {level!r} is not one of {', '.join(ROW_PREFETCH_LEVELS)}")
        self.lib.vs_set_row_prefetch(int(level == "nta"))
        try:
            yield
        finally:
            self.lib.vs_set_row_prefetch(int(self.row_prefetch == "nta"))

    def rope(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """RoPE in place on the first `heads` heads of every row of x (float32 [N, W], rows contiguous, W >= heads
        x head_dim): HF's rotate_half with the signed sine table (models/rope.py), cos and sin float32 [N, (1,)
        head_dim]."""
        if x.dtype != torch.float32 or x.stride(1) != 1 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise ValueError("rope: float32 rows with contiguous elements")
        cos, sin = cos.reshape(x.shape[0], head_dim).contiguous(), sin.reshape(x.shape[0], head_dim).contiguous()
        if self.lib.vs_rope(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr()):
            raise ValueError(f"rope: head_dim {head_dim} must be even and at most 512")

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                  reference: bool = False) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd) + bias) v for float32 CPU tensors: q [B, M, hd]; k, v [B, L, hd] (any batch
        and row strides, the last dimension contiguous; a batch stride of 0 shares one key set); bias
        [B or 1, M or 1, L] or None. Returns [B, M, hd]. A row with no visible key (all -inf) gives zeros."""
        B, M, hd = q.shape
        L = k.shape[1]
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        bb = bm = 0
        if bias is not None:
            bias = bias.expand(B, M, L)
            if bias.stride(-1) != 1:
                bias = bias.contiguous()
            bb, bm = bias.stride(0), bias.stride(1)
        out = torch.empty(B, M, hd, dtype=torch.float32)
        rc = self.lib.vs_attention(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                                   v.data_ptr(), v.stride(0), v.stride(1), None if bias is None else bias.data_ptr(),
                                   bb, bm, B, M, L, hd, hd**-0.5, out.data_ptr(), torch.get_num_threads(),
                                   int(reference))
        if rc:
            raise MemoryError("vs_attention: out of memory")
        return out


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
    return resources.files("verispec.execution").joinpath("csrc", SOURCE).read_bytes()


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


def _cached_build(cc: str, version: str, flags: tuple[str, ...], cache: Path) -> Path:
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


def _declare(lib: ctypes.CDLL) -> None:
    """The C functions' argument and result types (csrc/cpu.c), so that ctypes passes 64-bit sizes and pointers."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.vs_linear.argtypes = [p, i32, i64, i64, p, i32, i64, p, i32, i32, i32, p, ctypes.c_float, p, i32]
    lib.vs_linear.restype = i32
    lib.vs_attention.argtypes = [p, i64, i64, p, i64, i64, p, i64, i64, p, i64, i64, i64, i64, i64, i64,
                                 ctypes.c_float, p, i32, i32]
    lib.vs_attention.restype = i32
    lib.vs_rope.argtypes = [p, i64, i64, i64, i64, p, p]
    lib.vs_rope.restype = i32
    f32 = ctypes.c_float
    lib.vs_decoder.argtypes = [p, i64, p, p, i64, i64, i64, i64, i64, f32, f32, p, i64, p, p, p, p, p, p, p, p, p,
                               i64, i64, p, i64, i32, i32]
    lib.vs_decoder.restype = i32
    lib.vs_to_f16.argtypes = [p, i64, p, i32]
    lib.vs_to_f16.restype = i32
    lib.vs_bodies.restype = i32
    lib.vs_set_body.argtypes = [i32]
    lib.vs_set_body.restype = i32
    lib.vs_set_attention_rows.argtypes = [i32]
    lib.vs_set_attention_rows.restype = i32
    lib.vs_set_prefetch.argtypes = [i32]
    lib.vs_set_prefetch.restype = i32
    lib.vs_set_row_prefetch.argtypes = [i32]
    lib.vs_set_row_prefetch.restype = i32
    lib.vs_tile_bytes.argtypes = [i32]
    lib.vs_tile_bytes.restype = i32


@functools.cache
def load(cache: Path | None = None) -> Library:
    """Build (once per machine) and load the kernel. Raises KernelUnavailable with the reason."""
    cc = compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler (set CC, or install gcc) to build verispec's CPU kernel")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"C compiler {cc!r} does not run: {e}") from e
    if cache is None:
        from verispec.models.hub import cache_dir

        cache = cache_dir()
    flags = build_flags()
    try:
        out = _cached_build(cc, version, flags, cache)
    except KernelUnavailable as e:
        if flags == build_flags(avx512=False):
            raise
        # a compiler too old for the AVX-512 VNNI intrinsics still builds the AVX2 body
        log.warning("verispec's CPU kernel: %s; building without the AVX-512 body", e)
        flags = build_flags(avx512=False)
        out = _cached_build(cc, version, flags, cache)
    openmp_marker = out.with_suffix(".openmp")
    try:
        lib = ctypes.CDLL(str(out))
    except OSError as e:
        raise KernelUnavailable(f"built {out} but could not load it: {e}") from e
    _declare(lib)
    built = tuple(name for name, code in BODIES.items() if lib.vs_bodies() & (1 << code))
    library = Library(lib, out, flags, openmp_marker.exists(), built, built[-1])
    body, choice = choose_body(library)
    if lib.vs_set_body(BODIES[body]):
        raise KernelUnavailable(f"{out} does not have its own {body} body")
    library = dataclasses.replace(library, body=body, choice=choice)
    prefetch, why = choose_prefetch(library, cache=cache)
    lib.vs_set_prefetch(PREFETCH_CODES[prefetch])
    library = dataclasses.replace(library, prefetch=prefetch, prefetch_choice=why)
    row, why = choose_row_prefetch(library, cache=cache)
    lib.vs_set_row_prefetch(int(row == "nta"))
    library = dataclasses.replace(library, row_prefetch=row, row_prefetch_choice=why)
    log.info("verispec's CPU kernel: %s", library.describe())
    return library


# the shapes the body choice times: the default model's gate_up (Q4_1 [3072, 576]) and down (Q4_1 [576, 1536])
BODY_SHAPES = ((3072, 576), (576, 1536))
BODY_ROWS = (1, 8)


def _fastest(arms: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Seconds of each arm's fastest of `repeats` rounds, the arms interleaved, after one warm-up round (packing,
    allocator, thread pool): another process stealing the CPU slows a round, never speeds one."""
    best = dict.fromkeys(arms, float("inf"))
    for r in range(repeats + 1):
        for name, run in arms.items():
            t0 = time.perf_counter()
            run()
            if r:
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def choose_body(library: Library, repeats: int = 5) -> tuple[str, str]:
    """(the fastest vector body built into `library`, the timings that say so). Each body gives the same bits, so
    this is speed only: random Q4_1 weights of the default model's MLP shapes, one and eight rows, the bodies
    interleaved, the fastest of `repeats` rounds each (about 20 ms). With one vector body (or none) nothing is
    timed. `VERISPEC_CPU_BODY` names one instead (for side-by-side runs of whole benchmarks)."""
    asked = os.environ.get(BODY_ENV)
    if asked:
        if asked not in library.bodies:
            raise KernelUnavailable(f"{BODY_ENV}={asked}: not a body of this build ({', '.join(library.bodies)})")
        return asked, f"{BODY_ENV}={asked}"
    vector = [b for b in library.bodies if b != "portable"]
    if len(vector) <= 1:
        return library.bodies[-1], "the only vector body built" if vector else "no vector body for this CPU"
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n, k in BODY_SHAPES:
        raw = torch.randint(0, 256, (-(-n // 8), k // 32, 160), dtype=torch.uint8, generator=gen)
        raw[..., :32] = torch.full((16,), 0.01, dtype=torch.float16).view(torch.uint8)  # d[8], m[8]: finite
        for m in BODY_ROWS:
            cases.append((raw, n, k, torch.randn(m, k, generator=gen), torch.empty(m, n)))
    def run(body: str) -> None:
        for raw, n, k, x, out in cases:
            library.linear(raw, "Q4_1", n, k, x, out, body=body)

    best = _fastest({b: functools.partial(run, b) for b in vector}, repeats)
    body = min(vector, key=best.get)
    timings = ", ".join(f"{b} {best[b] * 1e3:.2f} ms" for b in vector)
    return body, f"fastest measured: {timings} for the MLP linears at M = {'/'.join(map(str, BODY_ROWS))}"


PREFETCH_ROWS = (4, 8)  # the rows the levels are timed at (the pair streams run from 4 rows on)
PREFETCH_MARGIN = 0.02  # L2 must be this much faster to replace L1, the first choice: noise does not flip it


# the weights one forward of the default model streams: per layer q|k|v, o, gate|up and down as Q4_1 [N, K], then
# the Q8_0 head (93 MiB in all, more than a CPU's last-level cache, as the model's own weights are)
FORWARD_LAYERS = 30
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD_SHAPE = (49152, 576)


def _forward_weights(library: Library) -> list[tuple[torch.Tensor, str, int, int]]:
    """(tiles, kind, N, K) of every weight of one default-model forward, in order: distinct memory, so they stream
    from memory as a forward's do; the levels differ only there (from a cache every level is alike). Filled with
    0x11 bytes (fp16 scales 0x1111: small, normal), since the speed does not depend on the values."""
    def tiles(kind: str, n: int, k: int) -> torch.Tensor:
        return torch.full((-(-n // 8), k // 32, library.lib.vs_tile_bytes(KINDS[kind])), 0x11, dtype=torch.uint8)

    out = [(tiles("Q4_1", n, k), "Q4_1", n, k) for _ in range(FORWARD_LAYERS) for n, k in LAYER_SHAPES]
    return out + [(tiles("Q8_0", *HEAD_SHAPE), "Q8_0", *HEAD_SHAPE)]


def _named_level(env: str, levels: tuple[str, ...]) -> tuple[str, str] | None:
    """(level, why) where the environment variable `env` names one of `levels`; None where it is not set."""
    asked = os.environ.get(env)
    if not asked:
        return None
    if asked not in levels:
        raise KernelUnavailable(f"{env}={asked}: not one of {', '.join(levels)}")
    return asked, f"{env}={asked}"


def _known_level(env: str, levels: tuple[str, ...], file: Path | None) -> tuple[str, str] | None:
    """(level, why) named by `env`, else measured on this machine before and kept in `file` (why + ", cached");
    None where neither says."""
    named = _named_level(env, levels)
    if named or file is None or not file.exists():
        return named
    kept = json.loads(file.read_text())
    return kept["level"], f"{kept['why']}, cached"


def _keep_level(file: Path | None, level: str, why: str) -> None:
    """Keep a measured level for later starts, unless other processes loaded the machine while it was measured."""
    if file is not None and not machine_busy():
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"level": level, "why": why, "cpu": cpu_info().as_dict(), "measured": time.time()}))
        tmp.replace(file)


def _fastest_level(best: dict[str, float], default: str = "l1") -> str:
    """The fastest level, where it beats `default` (the build's first choice) by PREFETCH_MARGIN; else default."""
    level = min(best, key=best.get)
    return level if best[level] < (1 - PREFETCH_MARGIN) * best[default] else default


def choose_prefetch(library: Library, repeats: int = 3, cache: Path | None = None) -> tuple[str, str]:
    """(where the AVX-512 body's pair streams are fetched ahead to, the timings that say so); ("l1", "") where that
    body does not run. It depends on the CPU's caches and prefetchers and shows only on weights that stream from
    memory: so the levels (L1, L2, non-temporal) are timed on the linears of one forward of the default model
    (`_forward_weights`, 93 MiB) at 4 and 8 rows, interleaved, the fastest of `repeats` rounds each (about 0.2 s).
    The choice is kept in `cache` per machine (CPU, threads, kernel source), as the path profile is, so later starts
    pay nothing; a busy machine's measurement is used but not kept. Each level gives the same bits.
    `VERISPEC_CPU_PREFETCH` (l1, l2, nta) names one instead."""
    if library.body != "avx512-vnni":
        return "l1", ""
    file = None if cache is None else cache / "kernels" / f"prefetch-{_prefetch_key()}.json"
    if known := _known_level(PREFETCH_ENV, PREFETCH_LEVELS, file):
        return known
    weights = _forward_weights(library)
    xs = {(m, k): torch.randn(m, k, generator=torch.Generator().manual_seed(m))
          for m in PREFETCH_ROWS for k in {k for *_, k in weights}}
    outs = {(m, n): torch.empty(m, n) for m in PREFETCH_ROWS for _, _, n, _ in weights}

    def run(level: str) -> None:
        with library.prefetching(level):
            for m in PREFETCH_ROWS:
                for raw, kind, n, k in weights:
                    library.linear(raw, kind, n, k, xs[m, k], outs[m, n])

    best = _fastest({lv: functools.partial(run, lv) for lv in PREFETCH_LEVELS}, repeats)
    level = _fastest_level(best)
    timings = ", ".join(f"{lv.upper()} {best[lv] * 1e3:.1f} ms" for lv in PREFETCH_LEVELS)
    why = f"measured: {timings} for one forward's linears at M = {'/'.join(map(str, PREFETCH_ROWS))}"
    _keep_level(file, level, why)
    return level, why


class _StepProbe:
    """The kind of small work an engine step does after its forward, on state of its own: a few torch ops on small
    tensors, an embedding row looked up, an argmax and an exp-sum over a vocabulary row through numpy. Fast where
    its code and data are still cached, several times slower where a forward's weight stream evicted them."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(4096, 576, generator=g)
        self.row = torch.randn(8192, generator=g).numpy()
        self.small = torch.zeros(16)

    def __call__(self) -> None:
        ids = torch.tensor([7, 4000])
        torch.nn.functional.embedding(ids, self.table)
        j = int(self.row.argmax())
        float(np.exp(self.row - self.row[j]).sum())
        for _ in range(4):
            self.small.add_(1.0)


def choose_row_prefetch(library: Library, repeats: int = 7, cache: Path | None = None) -> tuple[str, str]:
    """(where the vector bodies' single-tile streams of fewer rows are fetched ahead to, the timings that say so);
    ("l1", "") where no vector body runs. Into L1 (the build's first choice) or non-temporally: which is faster
    depends on what the CPU does with non-temporal lines, and shows on a forward's stream from memory and on what
    it evicts. So both are timed on the linears of one forward of the default model at one row followed by a small
    step's work (`_StepProbe`), interleaved, the fastest of `repeats` rounds each (about 0.1 s); kept per machine
    as `choose_prefetch`'s choice is. Each level gives the same bits. `VERISPEC_CPU_ROW_PREFETCH` (l1, nta) names
    one instead."""
    if library.body not in ("avx2", "avx512-vnni"):
        return "l1", ""
    file = None if cache is None else cache / "kernels" / f"row-prefetch-{_prefetch_key(library.body)}.json"
    if known := _known_level(ROW_PREFETCH_ENV, ROW_PREFETCH_LEVELS, file):
        return known
    weights = _forward_weights(library)
    xs = {k: torch.randn(1, k, generator=torch.Generator().manual_seed(k)) for *_, k in weights}
    outs = {n: torch.empty(1, n) for _, _, n, _ in weights}
    probe = _StepProbe()

    def run(level: str) -> None:
        with library.row_prefetching(level):
            for raw, kind, n, k in weights:
                library.linear(raw, kind, n, k, xs[k], outs[n])
            probe()

    best = _fastest({lv: functools.partial(run, lv) for lv in ROW_PREFETCH_LEVELS}, repeats)
    level = _fastest_level(best)
    timings = ", ".join(f"{lv.upper()} {best[lv] * 1e3:.2f} ms" for lv in ROW_PREFETCH_LEVELS)
    why = f"measured: {timings} for one forward's linears at M = 1 and a small step's work after them"
    _keep_level(file, level, why)
    return level, why


def _prefetch_key(body: str = "avx512-vnni") -> str:
    """What a kept prefetch choice is valid for: this CPU, the thread count, the kernel source and the body timed."""
    cpu = cpu_info()
    parts = [cpu.model, " ".join(cpu.flags), str(torch.get_num_threads()), source_digest(), str(PREFETCH_ROWS)]
    if body != "avx512-vnni":  # the pair levels' key as it was
        parts.append(body)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def fast_kernel_available() -> tuple[bool, str]:
    """(whether a vector body (AVX2, or AVX-512 VNNI beside it) is built and loaded here, why not / what runs)."""
    try:
        lib = load()
    except KernelUnavailable as e:
        return False, str(e)
    if not lib.avx2:
        return False, f"this CPU lacks one of {', '.join(AVX2_FLAGS)}: only the slow portable kernel"
    return True, lib.describe()
