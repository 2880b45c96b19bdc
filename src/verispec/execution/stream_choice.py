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
The pair streams of 5 rows and more keep the machine's level: on that Xeon a 1.5B model's 5-row forward took 55.6
ms with L1 and 55.2 with L2, within the noise.
"""

from __future__ import annotations

import functools
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


@dataclass(frozen=True)
class StreamChoice:
    level: str  # where the one-row (single-tile) weight streams are fetched ahead to: "l1", "l2" or "nta"
    why: str  # the timings that chose it (", cached" where read back)
    nbytes: int  # the model's kernel weights

    def describe(self) -> str:
        from verispec.kernels.cpu_kernels import where_to

        return (f"this model's {self.nbytes / 2**30:.2f} GiB of kernel weights fetched ahead {where_to(self.level)} "
                f"below 5 rows ({self.why})")


def kernel_weights(model: torch.nn.Module) -> list[Q8ActWeight]:
    """Every linear of `model` that runs on the kernel, in module order."""
    return [m for m in model.modules() if isinstance(m, Q8ActWeight)]


def choose_model_streams(model: LlamaModel, cache: Path | None, min_bytes: int = MIN_BYTES,
                         repeats: int = REPEATS) -> StreamChoice | None:
    """Time and set the one-row prefetch level on `model`'s own forwards where its kernel weights reach
    `min_bytes`; None where they do not, where none run on the kernel, or where no vector body runs (the machine's
    level then stays)."""
    weights = kernel_weights(model)
    nbytes = sum(w.tiles.nbytes for w in weights)
    if not weights or nbytes < min_bytes:
        return None
    context = min(CONTEXT, model.max_positions - 1)
    if context < 1:
        return None
    from verispec.kernels.cpu_kernels import load
    from verispec.kernels.kernel_choice import PREFETCH_CODES, StepProbe, choose_level_by

    library = load()
    if not library.row_prefetch_choice:
        return None
    size = 1 << max(0, (nbytes - 1) >> 20).bit_length()  # MiB, rounded up to a power of two

    @functools.cache
    def state():  # a short context prefilled, only where a level is timed
        ids = torch.arange(context + 1) * 7 % model.cfg.vocab_size  # [context + 1]
        kv, slot, _ = model.prefill_fresh(ids[:context], max_len=context + 1)
        return ids, kv, slot, StepProbe()

    def one_pass() -> float:
        ids, kv, slot, probe = state()
        t0 = time.perf_counter()
        model(ids[context:context + 1], [Segment(slot, context, 1)], kv, logits_indices=range(1))
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

    with torch.inference_mode():
        level, why = choose_level_by(library, False, timed, repeats, cache, scope=f"model-{size}mib",
                                     what=f"this model's one-row forward ({nbytes / 2**30:.2f} GiB) and a small "
                                          f"step's work after it")
    library.lib.vs_set_row_prefetch(PREFETCH_CODES[level])
    return StreamChoice(level, why, nbytes)
