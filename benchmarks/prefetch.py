"""Where the kernel's AVX-512 body fetches its weight streams ahead to (L1 or L2), end to end: plain decoding and
n-gram speculation under dspark, the two levels side by side.

From 4 rows on, the AVX-512 VNNI body reads two tiles of weights per vector, in two streams fetched ahead by
software prefetch. Into L1 (the build's first choice, measured on an Ice Lake CPU) or into L2 (measured faster on
a Zen 4 CPU: two streams 64 tiles ahead overflow its 32 KB L1): the loader times both at start and keeps the
faster (`execution/cpu_kernels.py` `choose_prefetch`); this benchmark shows what the choice is worth to a verify
step. The level changes no bit: every arm's output is compared with plain decoding's.

The arms: plain (the loader's level), plain with L1, n-gram under dspark (K up to 8) with L1, the same with the
loader's level. A plain step is one row and never reaches the pair streams, so the two plain arms differ only by
noise: their ratio is the run's noise floor.

Conditions (MEASURE.md): concurrency 1, in process, the default model on `dtype auto`; greedy, `--max-tokens`,
the first `--limit` prompts of each shipped workload, `--repeats` repeats, the arms interleaved (order rotated per
prompt and repeat). Metric: output tok/s of one stream, prefill included. Baseline: plain decoding on the same
prompts in the same repeat (`pooled`: all tokens / all seconds per repeat; `per prompt`: median (min..max)).

    python benchmarks/prefetch.py --limit 10 --repeats 2      (about 4 minutes on a 2-core CPU)
"""

from __future__ import annotations

import sys

from verispec import LLM
from verispec.bench.interleave import compare_arms
from verispec.execution.cpu_kernels import load


class AtLevel:
    """An engine whose requests run with the kernel's pair streams fetched ahead into `level`."""

    def __init__(self, llm: LLM, level: str) -> None:
        self.llm, self.level, self.lib = llm, level, load()

    def __getattr__(self, name: str):
        return getattr(self.llm, name)

    def chat(self, *args, **kwargs):
        with self.lib.prefetching(self.level):
            return self.llm.chat(*args, **kwargs)


def arms(base: LLM, k: int) -> dict:
    lib = load()
    if lib.body != "avx512-vnni":
        raise SystemExit(f"the {lib.body} body runs here: only the AVX-512 body has the prefetch levels")
    print(f"verispec's kernel: {lib.describe()}")
    spec = base.with_speculation({"method": "ngram", "num_speculative_tokens": k})
    chosen = lib.prefetch
    return {"plain": base, "plain, L1": AtLevel(base, "l1"), "ngram dspark, L1": AtLevel(spec, "l1"),
            f"ngram dspark, {chosen.upper()} (chosen)": AtLevel(spec, chosen)}


if __name__ == "__main__":
    sys.exit(compare_arms(__doc__, arms, default_limit=10))
