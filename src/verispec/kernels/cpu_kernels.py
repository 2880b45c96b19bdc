"""verispec's own CPU kernels (csrc/cpu.c), built at first use for the CPU at hand (kernels/cpu_build.py) and
loaded with ctypes: the GGUF-block matmul with int8 activations (kernels/q8act.py) and fp32 attention of a few
query rows (`Library.attention`) and RoPE in place (`Library.rope`), the gguf-q8act path's attention; and
`vs_decoder`, all of a forward's decoder layers in one call (models/decoder_kernel.py).

Every matmul body computes the same bits (the tests hold each to the portable one), so which one runs, and where
its weight streams are fetched ahead to, are questions of speed only: timed at load (kernels/kernel_choice.py),
and every report says which (`Library.describe()`). OpenMP is used where the compiler has it; torch's own OpenMP
runtime, already loaded, serves the library, so its threads are torch's threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from verispec.kernels.cpu_build import (AVX2_FLAGS, BODIES, KINDS, KernelUnavailable, build_flags, cached_build,
                                          compiler)
from verispec.kernels.threads import kernel_threads
from verispec.kernels.kernel_choice import (PREFETCH_CODES, ROW_PREFETCH_CODES, choose_body, choose_prefetch,
                                              choose_row_prefetch, forward_weights)

log = logging.getLogger(__name__)

BODY_NAMES = {"portable": "portable C", "avx2": "AVX2+FMA+F16C", "avx512-vnni": "AVX-512 VNNI"}


@dataclass(frozen=True)
class Library:
    lib: ctypes.CDLL
    path: Path
    flags: tuple[str, ...]  # the compiler flags it was built with
    openmp: bool
    bodies: tuple[str, ...] = ("portable",)  # the matmul bodies built in (BODIES' names)
    body: str = "portable"  # the one that runs (vs_set_body), the fastest measured at load
    choice: str = ""  # why: the timings that chose it
    prefetch: str = "l1"  # where the AVX-512 body's pair streams (5 rows on) are fetched ahead to, measured at load
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
        pairs = self.lib.vs_set_pair_rows(0)  # reads the threshold (rows < 1 changes nothing)
        prefetch = (f", from {pairs} rows on weights fetched ahead into {self.prefetch.upper()} ({self.prefetch_choice})"
                    if self.prefetch_choice else "")
        if self.row_prefetch_choice:
            rows = f"below {pairs} rows" if self.body == "avx512-vnni" else "weights fetched ahead"
            prefetch += f", {rows} {where_to(self.row_prefetch)} ({self.row_prefetch_choice})"
        return (f"{BODY_NAMES[self.body]} body{f' ({self.choice})' if self.choice else ''}{prefetch}, "
                f"{'OpenMP' if self.openmp else 'one thread'}, built with {' '.join(self.flags)}")

    def linear(self, packed: torch.Tensor, kind: str | torch.Tensor, n: int, k: int, x: torch.Tensor,
               out: torch.Tensor, reference: bool = False, norm: torch.Tensor | None = None, eps: float = 0.0,
               residual: torch.Tensor | None = None, swiglu: bool = False, body: str | None = None) -> None:
        """out [M, N] = x' [M, K] times the packed [N, K] weight's transpose (kernels/q8act.py's layout; `kind` its
        format, or an int64 [parts, 3] layout of parts stacked along N: C kind, rows, byte offset), plus
        `residual` (float32 [M, N]) when given; x' = x, or RMSNorm(x) * norm (float32 [K]) with `eps` when `norm`
        is given, or silu(gate) * up of a float32 x = [gate | up] ([M, 2K]) when `swiglu`. x and out: contiguous
        CPU float32 or bfloat16. `body`: one of `bodies` (default: the active one); `reference`: the portable."""
        code = self._code("portable") if reference else self._code(body) if body is not None else 0
        layout = torch.tensor([KINDS[kind], n, 0], dtype=torch.int64) if isinstance(kind, str) else kind
        rc = self.lib.vs_linear(packed.data_ptr(), layout.data_ptr(), layout.numel() // 3, n, k, x.data_ptr(),
                                x.dtype == torch.bfloat16,
                                x.shape[0], out.data_ptr(), out.dtype == torch.bfloat16, kernel_threads(),
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

    def prefetching(self, level: str) -> contextlib.AbstractContextManager[None]:
        """Inside the block the AVX-512 body's pair streams are fetched ahead to `level` ("l1", "l2" or "nta":
        non-temporally); after it, the level in force before. For benchmarks that compare them side by side (the
        bits are the same in each)."""
        return _at_level(self.lib.vs_set_prefetch, PREFETCH_CODES, "prefetch", level)

    def row_prefetching(self, level: str) -> contextlib.AbstractContextManager[None]:
        """Inside the block the single-tile weight streams (fewer rows than a pair takes) are fetched ahead to
        `level` ("l1", "l2" or "nta"); after it, the level in force before. For benchmarks and for timing the
        levels (the bits are the same)."""
        return _at_level(self.lib.vs_set_row_prefetch, ROW_PREFETCH_CODES, "row prefetch", level)

    def row_prefetch_now(self) -> str:
        """The level the single-tile streams are fetched ahead to now: the machine's (`row_prefetch`), or the one
        timed on a loaded model's own forwards (execution/stream_choice.py)."""
        return _level_name(self.lib.vs_row_prefetch(), ROW_PREFETCH_CODES)

    def prefetch_now(self) -> str:
        """The level the AVX-512 body's pair streams are fetched ahead to now (as `row_prefetch_now`)."""
        return _level_name(self.lib.vs_pair_prefetch(), PREFETCH_CODES)

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
                                   bb, bm, B, M, L, hd, hd**-0.5, out.data_ptr(), kernel_threads(),
                                   int(reference))
        if rc:
            raise MemoryError("vs_attention: out of memory")
        return out


@contextlib.contextmanager
def _at_level(set_level: Callable[[int], int], codes: dict[str, int], what: str, level: str) -> Iterator[None]:
    """`set_level(codes[level])` inside the block; after it the level that was in force before (the setter
    returns it)."""
    if level not in codes:
        raise ValueError(f"{what} level {level!r} is not one of {', '.join(codes)}")
    was = set_level(codes[level])
    try:
        yield
    finally:
        set_level(was)


def _level_name(code: int, codes: dict[str, int]) -> str:
    """The name of the level the C side reports in force."""
    return next(name for name, c in codes.items() if c == code)


def where_to(level: str) -> str:
    """A prefetch level in words."""
    return {"nta": "non-temporally", "l2": "into L2"}.get(level, "into L1")


def _declare(lib: ctypes.CDLL) -> None:
    """The C functions' argument and result types (csrc/cpu.c), so that ctypes passes 64-bit sizes and pointers."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.vs_linear.argtypes = [p, p, i32, i64, i64, p, i32, i64, p, i32, i32, i32, p, ctypes.c_float, p, i32]
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
    for getter in (lib.vs_row_prefetch, lib.vs_pair_prefetch):
        getter.argtypes = []
        getter.restype = i32
    lib.vs_set_pair_rows.argtypes = [i32]
    lib.vs_set_pair_rows.restype = i32
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
        from verispec.config import cache_dir

        cache = cache_dir()
    flags = build_flags()
    try:
        out = cached_build(cc, version, flags, cache)
    except KernelUnavailable as e:
        if flags == build_flags(avx512=False):
            raise
        # a compiler too old for the AVX-512 VNNI intrinsics still builds the AVX2 body
        log.warning("verispec's CPU kernel: %s; building without the AVX-512 body", e)
        flags = build_flags(avx512=False)
        out = cached_build(cc, version, flags, cache)
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
    weights = functools.cache(functools.partial(forward_weights, library))  # made where a level is measured
    prefetch, why = choose_prefetch(library, cache=cache, weights=weights)
    lib.vs_set_prefetch(PREFETCH_CODES[prefetch])
    library = dataclasses.replace(library, prefetch=prefetch, prefetch_choice=why)
    row, why = choose_row_prefetch(library, cache=cache, weights=weights)
    lib.vs_set_row_prefetch(ROW_PREFETCH_CODES[row])
    library = dataclasses.replace(library, row_prefetch=row, row_prefetch_choice=why)
    log.info("verispec's CPU kernel: %s", library.describe())
    return library


def fast_kernel_available() -> tuple[bool, str]:
    """(whether a vector body (AVX2, or AVX-512 VNNI beside it) is built and loaded here, why not / what runs)."""
    try:
        lib = load()
    except KernelUnavailable as e:
        return False, str(e)
    if not lib.avx2:
        return False, f"this CPU lacks one of {', '.join(AVX2_FLAGS)}: only the slow portable kernel"
    return True, lib.describe()
