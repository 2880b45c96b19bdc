"""What verispec's CPU kernel runs with, measured when it loads: which matmul body, and where its weight streams are
fetched ahead to. Every body and level computes the same bits (the tests hold each to the portable body), so each
choice is speed only, timed on this machine and said in every report (`Library.describe()`).

- The body: the vector bodies built here timed on the default model's layer shapes at one and eight rows
  (`choose_body`, or `VERISPEC_CPU_BODY`).
- The AVX-512 body's pair streams (5 rows and more by the build; a loaded model's own forwards may start them
  earlier, execution/stream_choice.py): L1, L2 or non-temporally, whichever is faster on the linears of one
  forward streamed from memory (`choose_prefetch`, or `VERISPEC_CPU_PREFETCH`).
- The single-tile streams of fewer rows (both vector bodies): L1, L2 or non-temporally, whichever makes a
  one-row forward and the small work a step does after it faster (`choose_row_prefetch`, or
  `VERISPEC_CPU_ROW_PREFETCH`); timed again on a loaded model's own one-row forwards where its weights reach 32
  MiB (execution/stream_choice.py: separate linears are not a fused forward).

The prefetch choices are kept in the cache per machine (CPU, threads, kernel source), so only the first start pays
for them. `library` below is a loaded `cpu_kernels.Library` (not imported here: cpu_kernels imports this module).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from verispec.kernels.cpu import cpu_info, machine_busy
from verispec.kernels.cpu_build import KINDS, KernelUnavailable, source_digest

BODY_ENV = "VERISPEC_CPU_BODY"  # names the body to run instead of timing them
# where the AVX-512 body's pair streams (5 rows and more) are fetched ahead to (vs_set_prefetch)
PREFETCH_LEVELS = ("l1", "l2", "nta")
PREFETCH_CODES = {"l1": 0, "l2": 1, "nta": 2}
PREFETCH_ENV = "VERISPEC_CPU_PREFETCH"  # names the level instead of timing the levels
# where the vector bodies' single-tile streams (fewer rows) are fetched ahead to (vs_set_row_prefetch)
ROW_PREFETCH_LEVELS = PREFETCH_LEVELS
ROW_PREFETCH_CODES = PREFETCH_CODES
ROW_PREFETCH_ENV = "VERISPEC_CPU_ROW_PREFETCH"  # names the level instead of timing the levels
Weights = list[tuple[torch.Tensor, str, int, int]]  # (tiles, kind, N, K) per weight


# the shapes the body choice times: the default model's gate_up (Q4_1 [3072, 576]) and down (Q4_1 [576, 1536])
BODY_SHAPES = ((3072, 576), (576, 1536))
BODY_ROWS = (1, 8)


def _fastest(arms: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Seconds of each arm's fastest of `repeats` rounds, the arms interleaved, after one warm-up round (packing,
    allocator, thread pool): another process stealing the CPU slows a round, never speeds one. An arm that returns
    a float has timed itself (the part after its own warm-up: e.g. after the caches another arm left)."""
    best = dict.fromkeys(arms, float("inf"))
    for r in range(repeats + 1):
        for name, run in arms.items():
            t0 = time.perf_counter()
            got = run()
            if r:
                best[name] = min(best[name], got if isinstance(got, float) else time.perf_counter() - t0)
    return best


def choose_body(library: Any, repeats: int = 5) -> tuple[str, str]:
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


PREFETCH_ROWS = (5, 8)  # the rows the levels are timed at (the pair streams run from 5 rows on: cpu.c's PAIR_ROWS)
PREFETCH_MARGIN = 0.02  # L2 must be this much faster to replace L1, the first choice: noise does not flip it


# the weights one forward of the default model streams: per layer q|k|v, o, gate|up and down as Q4_1 [N, K], then
# the Q8_0 head (93 MiB in all: more than many CPUs' last-level cache, as the model's own weights are, but not all:
# a Xeon with a 260 MB L3 holds them, and there a level is timed on weights read from cache)
FORWARD_LAYERS = 30
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD_SHAPE = (49152, 576)


def forward_weights(library: Any) -> Weights:
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


def _measured_level(run: Callable[[str], object], levels: tuple[str, ...], repeats: int, file: Path | None,
                    digits: int, what: str) -> tuple[str, str]:
    """(level, why): `run(level)` timed for each of `levels` (`_fastest`); the fastest, where it beats "l1" (the
    build's first choice) by PREFETCH_MARGIN, else "l1"; kept in `file` (`_keep_level`)."""
    best = _fastest({lv: functools.partial(run, lv) for lv in levels}, repeats)
    level = min(best, key=best.get)
    if best[level] >= (1 - PREFETCH_MARGIN) * best["l1"]:
        level = "l1"
    timings = ", ".join(f"{lv.upper()} {best[lv] * 1e3:.{digits}f} ms" for lv in levels)
    why = f"measured: {timings} for {what}"
    _keep_level(file, level, why)
    return level, why


def choose_prefetch(library: Any, repeats: int = 3, cache: Path | None = None,
                    weights: Callable[[], Weights] | None = None) -> tuple[str, str]:
    """(where the AVX-512 body's pair streams are fetched ahead to, the timings that say so); ("l1", "") where that
    body does not run. It depends on the CPU's caches and prefetchers and shows only on weights that stream from
    memory: so the levels (L1, L2, non-temporal) are timed on the linears of one forward of the default model
    (`forward_weights`, 93 MiB) at 5 and 8 rows, interleaved, the fastest of `repeats` rounds each (about 0.2 s).
    The choice is kept in `cache` per machine (CPU, threads, kernel source), as the path profile is, so later starts
    pay nothing; a busy machine's measurement is used but not kept. Each level gives the same bits.
    `VERISPEC_CPU_PREFETCH` (l1, l2, nta) names one instead. `weights`: makes `forward_weights` (shared at load
    with `choose_row_prefetch`, so the 93 MiB are made once and only where a level is measured)."""
    @functools.cache
    def inputs():  # made only where a level is measured
        ws = weights() if weights is not None else forward_weights(library)
        xs = {(m, k): torch.randn(m, k, generator=torch.Generator().manual_seed(m))
              for m in PREFETCH_ROWS for k in {k for *_, k in ws}}
        return ws, xs, {(m, n): torch.empty(m, n) for m in PREFETCH_ROWS for _, _, n, _ in ws}

    def run(level: str) -> None:
        ws, xs, outs = inputs()
        with library.prefetching(level):
            for m in PREFETCH_ROWS:
                for raw, kind, n, k in ws:
                    library.linear(raw, kind, n, k, xs[m, k], outs[m, n])

    return choose_level_by(library, True, run, repeats, cache,
                           what=f"one forward's linears at M = {'/'.join(map(str, PREFETCH_ROWS))}", digits=1)


def choose_level_by(library: Any, pair: bool, run: Callable[[str], object], repeats: int, cache: Path | None,
                    what: str, scope: str = "", digits: int = 2) -> tuple[str, str]:
    """(where the pair streams (`pair`) or the single-tile streams are fetched ahead to, why): the level the
    environment names, else one kept in `cache` for this machine (and `scope`: e.g. a model's size), else the
    fastest of `run(level)` (which sets the level it times; it may time itself, as `_fastest` says), kept as
    `_measured_level` does. ("l1", "") where those streams do not run (no AVX-512 body for pairs, no vector body
    for rows)."""
    if library.body not in (("avx512-vnni",) if pair else ("avx2", "avx512-vnni")):
        return "l1", ""
    stem, env = ("prefetch", PREFETCH_ENV) if pair else ("row-prefetch", ROW_PREFETCH_ENV)
    key = _prefetch_key() if pair else _prefetch_key(library.body)
    file = None if cache is None else cache / "kernels" / f"{stem}-{key}{f'-{scope}' if scope else ''}.json"
    if known := _known_level(env, PREFETCH_LEVELS, file):
        return known
    return _measured_level(run, PREFETCH_LEVELS, repeats, file, digits, what)


class StepProbe:
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


def choose_row_prefetch(library: Any, repeats: int = 7, cache: Path | None = None,
                        weights: Callable[[], Weights] | None = None) -> tuple[str, str]:
    """(where the vector bodies' single-tile streams of fewer rows are fetched ahead to, the timings that say so);
    ("l1", "") where no vector body runs. Into L1 (the build's first choice), L2 or non-temporally: which is
    faster depends on the CPU's prefetchers, on where the weights come from (memory or the last-level cache) and on
    what a non-temporal stream spares. So the levels are timed on the linears of one forward of the default model
    at one row followed by a small step's work (`StepProbe`), interleaved, the fastest of `repeats` rounds each
    (about 0.1 s); kept per machine as `choose_prefetch`'s choice is. Each level gives the same bits.
    `VERISPEC_CPU_ROW_PREFETCH` (l1, l2, nta) names one instead. A loaded model's own forwards are timed again by
    execution/stream_choice.py (these linears, one call each, are not a fused forward)."""
    @functools.cache
    def inputs():  # made only where a level is measured
        ws = weights() if weights is not None else forward_weights(library)
        xs = {k: torch.randn(1, k, generator=torch.Generator().manual_seed(k)) for *_, k in ws}
        return ws, xs, {n: torch.empty(1, n) for _, _, n, _ in ws}, StepProbe()

    def run(level: str) -> None:
        ws, xs, outs, probe = inputs()
        with library.row_prefetching(level):
            for raw, kind, n, k in ws:
                library.linear(raw, kind, n, k, xs[k], outs[n])
            probe()

    return choose_level_by(library, False, run, repeats, cache,
                           what="one forward's linears at M = 1 and a small step's work after them")


def _prefetch_key(body: str = "avx512-vnni") -> str:
    """What a kept prefetch choice is valid for: this CPU, the thread count, the kernel source and the body timed."""
    cpu = cpu_info()
    parts = [cpu.model, " ".join(cpu.flags), str(torch.get_num_threads()), source_digest(), str(PREFETCH_ROWS)]
    if body != "avx512-vnni":  # the pair levels' key as it was
        parts.append(body)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]
