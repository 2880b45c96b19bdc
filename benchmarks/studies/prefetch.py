"""Where the kernel fetches its weight streams ahead to, end to end: plain decoding and n-gram (or learned
drafters') speculation under dspark, the levels side by side.

From 4 rows on, the AVX-512 VNNI body reads two tiles of weights per vector, in two streams fetched ahead by
software prefetch: into L1 (the build's first choice, measured on an Ice Lake CPU), into L2 (measured faster on a
Zen 4 CPU: two streams 64 tiles ahead overflow its 32 KB L1) or non-temporally. Fewer rows (every row count on the
AVX2 body) read one stream: into L1 or non-temporally (a CPU may then keep the forward's ~100 MB from evicting the
KV cache and the Python and torch state the step runs after it). The loader times the levels at start and keeps
the fastest (`kernels/kernel_choice.py` `choose_prefetch`, `choose_row_prefetch`); this benchmark shows what the
choices are worth to whole requests. No level changes a bit: every arm's output is compared with plain decoding's.

The arms: plain (the loader's levels), plain at each other pair of `--levels` (pair streams; default all three)
and `--row-levels` (single-tile streams; default the loader's), then each of `--drafters` (default n-gram;
`eagle3`, `dflash`, `dspark`: the shipped drafters, K up to 4 for them) under dspark at each pair. Plain steps are
one row and reach the pair streams only in prefill: plain arms that differ in the pair level alone differ by
little more than noise, a floor to read the rest against.

Conditions (MEASURE.md): concurrency 1, in process, the default model on `dtype auto`; greedy, `--max-tokens`,
the first `--limit` prompts of each shipped workload, `--repeats` repeats, the arms interleaved (order rotated per
prompt and repeat). Metric: output tok/s of one stream, prefill included. Baseline: plain decoding on the same
prompts in the same repeat (`pooled`: all tokens / all seconds per repeat; `per prompt`: median (min..max)).

    python benchmarks/studies/prefetch.py --limit 10 --repeats 2 --levels l1,l2      (about 4 minutes on a 2-core CPU)
    python benchmarks/studies/prefetch.py --drafters eagle3 --levels l2 --row-levels l1,nta --workloads code,chat,markdown
"""

from __future__ import annotations

import sys

from verispec import LLM
from verispec.bench.interleave import compare_arms
from verispec.bench.single import method_spec
from verispec.kernels.cpu_kernels import load
from verispec.kernels.kernel_choice import PREFETCH_LEVELS, ROW_PREFETCH_LEVELS

LEARNED_K = 4  # most draft tokens per step for the learned drafters (their speed's best in earlier runs)


class AtLevel:
    """An engine whose requests run with the kernel's pair streams fetched ahead to `level` and its single-tile
    streams to `row_level`."""

    def __init__(self, llm: LLM, level: str, row_level: str) -> None:
        self.llm, self.level, self.row_level, self.lib = llm, level, row_level, load()

    def __getattr__(self, name: str):
        return getattr(self.llm, name)

    def chat(self, *args, **kwargs):
        with self.lib.prefetching(self.level), self.lib.row_prefetching(self.row_level):
            return self.llm.chat(*args, **kwargs)


def arms_for(drafters: list[str], levels: list[str], row_levels: list[str]):
    def arms(base: LLM, k: int) -> dict:
        lib = load()
        if lib.body != "avx512-vnni":
            raise SystemExit(f"the {lib.body} body runs here: only the AVX-512 body has the prefetch levels")
        print(f"verispec's kernel: {lib.describe()}")

        def name(level: str, row: str) -> str:
            chosen = " (chosen)" if (level, row) == (lib.prefetch, lib.row_prefetch) else ""
            return f"{level.upper()}, rows {row.upper()}{chosen}"

        out = {"plain": base}  # the loader's levels
        for level in levels:
            for row in row_levels:
                if (level, row) != (lib.prefetch, lib.row_prefetch):
                    out[f"plain, {name(level, row)}"] = AtLevel(base, level, row)
        for drafter in drafters:
            spec = base.with_speculation(method_spec(drafter, k if drafter == "ngram" else LEARNED_K))
            for level in levels:
                for row in row_levels:
                    out[f"{drafter} dspark, {name(level, row)}"] = AtLevel(spec, level, row)
        return out

    return arms


def take(argv: list[str], flag: str, default: str) -> list[str]:
    """The comma list after `flag` in argv (removed from it), else `default`'s."""
    if flag not in argv:
        return default.split(",")
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i : i + 2]
    return value.split(",")


if __name__ == "__main__":
    argv = sys.argv[1:]
    lib = load()
    drafters = take(argv, "--drafters", "ngram")
    levels = take(argv, "--levels", ",".join(PREFETCH_LEVELS))
    row_levels = take(argv, "--row-levels", lib.row_prefetch)
    if set(levels) - set(PREFETCH_LEVELS) or set(row_levels) - set(ROW_PREFETCH_LEVELS):
        raise SystemExit(f"--levels: {', '.join(PREFETCH_LEVELS)}; --row-levels: {', '.join(ROW_PREFETCH_LEVELS)}")
    sys.exit(compare_arms(__doc__, arms_for(drafters, levels, row_levels), argv, default_limit=10))
