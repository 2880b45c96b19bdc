"""Where verispec's CPU kernel fetches a loaded model's one-row weight streams to, timed on that model's forwards.

The kernel's level (kernels/kernel_choice.py's `choose_row_prefetch`) is first chosen per machine on the default
model's linears, one kernel call each from Python, whose overhead and cache footprint are not a fused forward's;
and a model many times larger streams its weights from memory where those 93 MiB may stay in a large last-level
cache. Both showed on a 2-core Xeon with a 260 MB L3: the per-linear timing put L2 ahead of L1 (4.4 against
5.8 ms), while the default model's own one-row forwards took 2.4-2.5 ms with L1 and 2.6-2.8 with L2; a 1.5B
model's in Q8_0 took 72 ms with L1, 68 with L2, 128 non-temporally (docs/results/shapes.md). So a model whose
kernel weights reach `MIN_BYTES` has the level timed again on its own one-row forwards (each level gives the same
bits), kept per machine and size (MiB rounded up to a power of two, so the next model of that size pays nothing)
and set for the process: the level is the kernel's global setting, and the last model loaded is the one served.
The pair streams keep the machine's level: on that Xeon a 1.5B model's 5-row forward took 55.6 ms with L1 and
55.2 with L2, within the noise.

From how many rows on the AVX-512 body runs two tiles per vector (cpu.c's PAIR_ROWS, 5: measured on a Zen 4, where
pairs from 3 rows were no faster) is timed here too: on the Xeon the default model's forwards of 3 and 4 rows took
3.20 and 3.53 ms with pairs against 3.56 and 3.93 with one tile, and verify blocks of 2-5 rows are speculation's
common case. Each row count M of `PAIR_CANDIDATES` is timed both ways (`pair_rows_by` picks the threshold), kept per
machine and size beside the level and set for the process; only the speed changes, never a bit.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.kernels.q8act import Q8ActWeight
from verispec.models.llama import LlamaModel, Segment

MIN_BYTES = 32 << 20  # smaller models (tests' tiny ones) keep the machine's levels: their weights stay in cache
REPEATS = 2  # timed rounds per level, the fastest kept: about 1.5 s once for a 1.5B model, 0.1 s for the default one
CONTEXT = 32  # committed tokens before the timed forwards
WARM_PASSES, STEADY = 8, 0.95  # untimed passes per level and round: until one is not 5% faster than the one before
PAIR_CANDIDATES = (2, 3, 4, 5)  # the row counts timed with and without pairs (5: the build's threshold)
PAIR_REPEATS = 5  # rounds per row count and way (2 chose 2, 4 or 5 by run on the Xeon; 5 and 9 chose 3 each time):
# about 0.2 s once for the default model, 2.5 s for a 1.5B one
PAIR_MARGIN = 0.03  # pairs must be this much faster at a row count to start there
PAIR_ENV = "VERISPEC_CPU_PAIR_ROWS"  # names the threshold instead of timing it


@dataclass(frozen=True)
class StreamChoice:
    level: str | None  # where the one-row (single-tile) streams are fetched ahead to: "l1", "l2", "nta" (None: kept)
    why: str  # the timings that chose it (", cached" where read back)
    nbytes: int  # the model's kernel weights
    pair_rows: int | None = None  # from how many rows on two tiles run per vector (None: no AVX-512 body)
    pair_why: str = ""

    def describe(self) -> str:
        from verispec.kernels.cpu_kernels import where_to

        said = [f"fetched ahead {where_to(self.level)} at one row ({self.why})"] if self.level else []
        if self.pair_rows is not None:
            said.append(f"two tiles per vector from {self.pair_rows} rows on ({self.pair_why})")
        return f"this model's {self.nbytes / 2**30:.2f} GiB of kernel weights: " + "; ".join(said)


def pair_rows_by(times: dict[int, tuple[float, float]], fallback: int = PAIR_CANDIDATES[-1],
                 margin: float = PAIR_MARGIN) -> int:
    """The threshold from timings {rows M: (seconds with pairs, seconds with one tile per vector)}: the fewest rows
    from which pairs are faster by `margin` at every timed M up to the largest, else `fallback` (the build's)."""
    rows = sorted(times)
    for i, m in enumerate(rows):
        if all(times[r][0] < (1 - margin) * times[r][1] for r in rows[i:]):
            return m
    return fallback


def kernel_weights(model: torch.nn.Module) -> list[Q8ActWeight]:
    """Every linear of `model` that runs on the kernel, in module order."""
    return [m for m in model.modules() if isinstance(m, Q8ActWeight)]


def choose_model_streams(model: LlamaModel, cache: Path | None, min_bytes: int = MIN_BYTES,
                         repeats: int = REPEATS, pair_repeats: int = PAIR_REPEATS) -> StreamChoice | None:
    """Time and set the one-row prefetch level and the pair threshold on `model`'s own forwards where its kernel
    weights reach `min_bytes`; None where they do not, where none run on the kernel, or where no vector body runs
    (the machine's settings then stay)."""
    weights = kernel_weights(model)
    nbytes = sum(w.tiles.nbytes for w in weights)
    if not weights or nbytes < min_bytes:
        return None
    context = min(CONTEXT, model.max_positions - 1 - PAIR_CANDIDATES[-1])
    if context < 1:
        return None
    from verispec.kernels.cpu_kernels import load
    from verispec.kernels.kernel_choice import PREFETCH_CODES, StepProbe, choose_level_by

    library = load()
    pairs_run = library.body == "avx512-vnni"
    if not library.row_prefetch_choice and not pairs_run:
        return None
    size = 1 << max(0, (nbytes - 1) >> 20).bit_length()  # MiB, rounded up to a power of two

    @functools.cache
    def state():  # a short context prefilled, only where something is timed
        ids = torch.arange(context + PAIR_CANDIDATES[-1]) * 7 % model.cfg.vocab_size  # [context + 5]
        kv, slot, _ = model.prefill_fresh(ids[:context], max_len=context + PAIR_CANDIDATES[-1])
        return ids, kv, slot, StepProbe()

    def one_pass(rows: int = 1) -> float:
        ids, kv, slot, probe = state()
        t0 = time.perf_counter()
        model(ids[context:context + rows], [Segment(slot, context, rows)], kv, logits_indices=range(rows))
        probe()  # the small work a step does after its forward
        kv.rollback(slot, context)
        return time.perf_counter() - t0

    def timed(level: str) -> float:
        """Seconds of a one-row forward at `level` once they stop getting faster: the passes after another level
        refill what its stream left out of the caches, which a process that keeps one level never pays (on the
        260 MB L3 Xeon, the default model's one-row forwards after non-temporal ones took 5.3, 4.3, 3.2, 2.7,
        then 2.4 ms with L1)."""
        with library.row_prefetching(level):
            last = float("inf")
            for _ in range(WARM_PASSES):
                t = one_pass()
                if t > STEADY * last:
                    break
                last = t
            return one_pass()

    level = why = None
    with torch.inference_mode():
        if library.row_prefetch_choice:
            level, why = choose_level_by(library, False, timed, repeats, cache, scope=f"model-{size}mib",
                                         what=f"this model's one-row forward ({nbytes / 2**30:.2f} GiB) and a small "
                                              f"step's work after it")
            library.lib.vs_set_row_prefetch(PREFETCH_CODES[level])
        pair_rows, pair_why = (choose_pair_rows(library, one_pass, pair_repeats, cache, f"model-{size}mib")
                               if pairs_run else (None, ""))
    return StreamChoice(level, why or "", nbytes, pair_rows, pair_why)


def choose_pair_rows(library, one_pass, repeats: int, cache: Path | None, scope: str) -> tuple[int, str]:
    """(the pair threshold, why), set in the kernel: named by `VERISPEC_CPU_PAIR_ROWS`, kept in `cache` for this
    machine and `scope`, or timed: `one_pass(rows)` at each of PAIR_CANDIDATES with pairs and with one tile per
    vector, interleaved, the fastest of `repeats` rounds (`pair_rows_by`)."""
    from verispec.kernels.kernel_choice import _fastest, _keep_level, _prefetch_key

    file = None if cache is None else cache / "kernels" / f"pair-rows-{_prefetch_key()}-{scope}.json"
    if asked := os.environ.get(PAIR_ENV):
        if not asked.isdigit() or int(asked) < 1:
            raise ValueError(f"{PAIR_ENV}={asked}: expected a row count of 1 or more")
        rows, why = int(asked), f"{PAIR_ENV}={asked}"
    elif file is not None and file.exists():
        kept = json.loads(file.read_text())
        rows, why = int(kept["level"]), f"{kept['why']}, cached"
    else:
        def arm(m: int, pairs: bool):
            def run() -> float:
                library.lib.vs_set_pair_rows(m if pairs else m + 1)
                return one_pass(m)
            return run

        was = library.lib.vs_set_pair_rows(0)
        try:
            best = _fastest({(m, p): arm(m, p) for m in PAIR_CANDIDATES for p in (True, False)}, repeats)
        finally:
            library.lib.vs_set_pair_rows(was)
        times = {m: (best[(m, True)], best[(m, False)]) for m in PAIR_CANDIDATES}
        rows = pair_rows_by(times)
        why = "measured: " + ", ".join(f"{m} rows {1e3 * a:.2f} ms with pairs, {1e3 * b:.2f} with one tile"
                                       for m, (a, b) in times.items())
        _keep_level(file, str(rows), why)
    library.lib.vs_set_pair_rows(rows)
    return rows, why
