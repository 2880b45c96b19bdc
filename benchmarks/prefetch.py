"""Where the kernel's AVX-512 body fetches its weight streams ahead to (L1 or L2), end to end: plain decoding and
n-gram speculation under dspark, the two levels side by side.

From 4 rows on, the AVX-512 VNNI body reads two tiles of weights per vector, in two streams fetched ahead by
software prefetch. Into L1 (the build's first choice, measured on an Ice Lake CPU) or into L2 (measured faster on
a Zen 4 CPU: two streams 64 tiles ahead overflow its 32 KB L1): the loader times both at start and keeps the
faster (`execution/cpu_kernels.py` `choose_prefetch`); this benchmark shows what the choice is worth to a verify
step. The level changes no bit: every arm's output is compared with plain decoding's.

The arms: plain (the loader's level), plain with L1, then for each of `--drafters` (default n-gram; `eagle3`,
`dflash`, `dspark`: the shipped drafters, K up to 4 for them) under dspark with L1 and with the loader's level. A
plain step is one row and never reaches the pair streams, so the two plain arms differ only by noise: their ratio
is the run's noise floor.

Conditions (MEASURE.md): concurrency 1, in process, the default model on `dtype auto`; greedy, `--max-tokens`,
the first `--limit` prompts of each shipped workload, `--repeats` repeats, the arms interleaved (order rotated per
prompt and repeat). Metric: output tok/s of one stream, prefill included. Baseline: plain decoding on the same
prompts in the same repeat (`pooled`: all tokens / all seconds per repeat; `per prompt`: median (min..max)).

    python benchmarks/prefetch.py --limit 10 --repeats 2      (about 4 minutes on a 2-core CPU)
    python benchmarks/prefetch.py --drafters ngram,eagle3 --workloads code,chat --limit 27
"""

from __future__ import annotations

import sys

from verispec import LLM
from verispec.bench.interleave import compare_arms
from verispec.bench.single import method_spec
from verispec.execution.cpu_kernels import load

LEARNED_K = 4  # most draft tokens per step for the learned drafters (their speed's best in earlier runs)


class AtLevel:
    """An engine whose requests run with the kernel's pair streams fetched ahead into `level`."""

    def __init__(self, llm: LLM, level: str) -> None:
        self.llm, self.level, self.lib = llm, level, load()

    def __getattr__(self, name: str):
        return getattr(self.llm, name)

    def chat(self, *args, **kwargs):
        with self.lib.prefetching(self.level):
            return self.llm.chat(*args, **kwargs)


def arms_for(drafters: list[str]):
    def arms(base: LLM, k: int) -> dict:
        lib = load()
        if lib.body != "avx512-vnni":
            raise SystemExit(f"the {lib.body} body runs here: only the AVX-512 body has the prefetch levels")
        print(f"verispec's kernel: {lib.describe()}")
        out = {"plain": base, "plain, L1": AtLevel(base, "l1")}
        for name in drafters:
            spec = base.with_speculation(method_spec(name, k if name == "ngram" else LEARNED_K))
            out[f"{name} dspark, L1"] = AtLevel(spec, "l1")
            out[f"{name} dspark, {lib.prefetch.upper()} (chosen)"] = AtLevel(spec, lib.prefetch)
        return out

    return arms


if __name__ == "__main__":
    argv = sys.argv[1:]
    drafters = ["ngram"]
    if "--drafters" in argv:
        i = argv.index("--drafters")
        drafters = argv[i + 1].split(",")
        del argv[i : i + 2]
    sys.exit(compare_arms(__doc__, arms_for(drafters), argv, default_limit=10))
