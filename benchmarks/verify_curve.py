"""The verify cost curve of every weight path: one whole target forward (linears, attention, norms, head) over a
block of M new tokens after a fixed context, by M, for each path `dtype="auto"` can choose, and which one it chose.

Conditions (MEASURE.md): concurrency 1 (one sequence, one forward at a time, in process); metric: median ms of one
forward of M tokens after `--context` committed tokens, logits for all M rows (as a verify block computes them),
and cost(M) / cost(1); baseline: each path's own M = 1, and the cheapest path at each M. The paths run
interleaved (order rotated every repeat) so a noisy neighbour slows all of them alike. The auto line says which
path `LLM(dtype="auto")` picks for plain decoding and for k = 8 drafts, from its profile of the linears.

    python benchmarks/verify_curve.py [--repeats 5] [--context 256] [--json OUT]     (about 2 minutes)

`--bodies` also runs the gguf-q8act path once per matmul body verispec's kernel has built for this CPU (AVX2, and
AVX-512 VNNI where the CPU has it), as rows `gguf-q8act[BODY]` interleaved with the rest, and checks that every
body's logits are bitwise those of the body the kernel chose; `--prefetch` runs it once per level the AVX-512
body's weight streams are fetched ahead to (rows `gguf-q8act[l1]`, `gguf-q8act[l2]`; the loader times both and
keeps the faster); `--attention-rows 1` runs it with each row's attention reading its keys alone (row
`gguf-q8act[rows=1]`) beside the default, where a task reads each key once for up to 64 rows of a sequence (the
same bits: checked before timing); `--paths` limits the paths (e.g. gguf-q8act); `--ms` the block sizes.

    python benchmarks/verify_curve.py --paths gguf-q8act --prefetch --ms 1,2,3,4,5,6,8,16 --repeats 15
    python benchmarks/verify_curve.py --paths gguf-q8act --attention-rows 1 --ms 1,2,4,8,16 --repeats 40
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics

import torch

from verispec.bench.decode_speed import forward_ms
from verispec.bench.load import MachineLoad
from verispec.config import ModelConfig
from verispec.execution.autotune import resolve_path
from verispec.execution.invariance import linears_row_invariant
from verispec.kernels.cpu import cpu_info
from verispec.execution.paths import candidates
from verispec.models import hub
from verispec.models.llama import LlamaModel, Segment
from verispec.models.loader import gguf_has_int4_linears, load_model, read_config, resolve

MS = (1, 2, 3, 4, 8, 16, 32)


def check_same_logits(model: LlamaModel, setting, what: str, ids: torch.Tensor) -> None:
    """The model's logits over a short prompt and a block of 8 after it, as the loader set the kernel and inside
    `setting()`: bitwise equal, or the benchmark stops (it would be comparing two arithmetics)."""
    outs = []
    for ctx in (contextlib.nullcontext, setting):
        with ctx():
            cache = model.new_cache(64)
            slot = cache.allocate()
            model.prefill(ids[:40], cache, slot)
            outs.append(model(ids[40:48], [Segment(slot, 40, 8)], cache, logits_indices=range(8)).logits)
    if not torch.equal(outs[0], outs[1]):
        raise SystemExit(f"{what}: the logits differ from the loader's setting: not the same arithmetic")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=hub.DEFAULT_MODEL)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--bodies", action="store_true", help="gguf-q8act once per matmul body built here")
    ap.add_argument("--prefetch", action="store_true",
                    help="gguf-q8act once per prefetch level of the AVX-512 body's pair streams (l1, l2, nta)")
    ap.add_argument("--attention-rows", default=None,
                    help="gguf-q8act also with at most N rows of a sequence per attention task (comma-separated)")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="block sizes M (must include 1 and 8)")
    ap.add_argument("--paths", default=None, help="comma-separated path names (default: every candidate)")
    args = ap.parse_args()
    ms_list = tuple(sorted({int(m) for m in args.ms.split(",")} | {1, 8}))
    resolved = resolve(args.model, progress=False)
    cfg = ModelConfig.from_hf(read_config(resolved.directory))
    int4 = gguf_has_int4_linears(resolved)
    paths = candidates("cpu", int4)
    if args.paths:
        paths = [p for p in paths if p.name in args.paths.split(",")]
    models = {p.name: load_model(resolved, dtype=p.dtype, quantization=p.quantization, progress=False)[0]
              for p in paths}
    ids = torch.arange(args.context + max(ms_list)) * 7 % cfg.vocab_size  # [context + max M]
    bodies = {}  # row name -> (model name, the kernel setting it runs inside)
    if (args.bodies or args.prefetch or args.attention_rows) and "gguf-q8act" in models:
        from verispec.kernels.cpu_kernels import load
        from verispec.kernels.kernel_choice import PREFETCH_LEVELS

        lib = load()
        print(f"verispec's kernel: {lib.describe()}")

        def variant(tag: str, setting, check: bool = True) -> None:
            """A row `gguf-q8act[tag]` run inside `setting()`, its logits checked against the loader's setting."""
            bodies[f"gguf-q8act[{tag}]"] = ("gguf-q8act", setting)
            if check:
                check_same_logits(models["gguf-q8act"], setting, tag, ids)

        for b in lib.bodies if args.bodies else ():
            if b != "portable":
                variant(b, functools.partial(lib.running, b))
        if args.prefetch and lib.body != "avx512-vnni":
            raise SystemExit(f"--prefetch: the {lib.body} body runs here, and only the AVX-512 one has the levels")
        for level in PREFETCH_LEVELS if args.prefetch else ():  # the levels' bits are held equal by the tests
            variant(level, functools.partial(lib.prefetching, level), check=False)
        for rows in map(int, args.attention_rows.split(",")) if args.attention_rows else ():
            variant(f"rows={rows}", functools.partial(lib.attending_rows, rows))
        if args.attention_rows and not (args.bodies or args.prefetch):
            bodies["gguf-q8act"] = ("gguf-q8act", contextlib.nullcontext)
    for m in models.values():  # as the engine runs them: per-query attention where the linears are invariant
        m.batch_invariant = all(linears_row_invariant(m).values())
    caches = {}
    for name, m in models.items():
        cache = m.new_cache(args.context + max(ms_list))
        slot = cache.allocate()
        m.prefill(ids[: args.context], cache, slot)
        caches[name] = (cache, slot)
    rows = {n: (n, contextlib.nullcontext) for n in models if not (bodies and n == "gguf-q8act")} | bodies
    times: dict[str, dict[int, list[float]]] = {n: {m: [] for m in ms_list} for n in rows}
    names = list(rows)
    load = MachineLoad().start()
    for r in range(args.repeats + 1):  # round 0 warms up
        for m in ms_list:
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                name, setting = rows[n]
                with setting():
                    ms = forward_ms(models[name], *caches[name], ids, args.context, m)
                if r:
                    times[n][m].append(ms)
    load.stop()
    print(load.describe())
    med = {n: {m: statistics.median(v) for m, v in t.items()} for n, t in times.items()}
    plain = resolve_path("auto", None, "cpu", cfg, int4, 0, cache=hub.cache_dir())
    spec = resolve_path("auto", None, "cpu", cfg, int4, 8, cache=hub.cache_dir())
    report(med, args, plain.describe(), spec.describe(), {n: models[rows[n][0]].batch_invariant for n in rows},
           ms_list)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms": med, "cpu": cpu_info().as_dict(), "threads": torch.get_num_threads(),
                       "auto_plain": plain.path.name, "auto_k8": spec.path.name, "context": args.context}, f)


def report(med: dict[str, dict[int, float]], args, plain: str, spec: str, invariant: dict[str, bool],
           ms_list: tuple[int, ...] = MS) -> None:
    print(f"CPU {cpu_info().label()}; torch {torch.__version__}, {torch.get_num_threads()} threads; context "
          f"{args.context}; median of {args.repeats} interleaved repeats; ms of one forward of M tokens")
    print("\n| path | batch-invariant attention | " + " | ".join(f"M={m}" for m in ms_list) + " | cost(8)/cost(1) |")
    print("|---|---|" + "---|" * (len(ms_list) + 1))
    for n, t in med.items():
        print(f"| {n} | {invariant[n]} | " + " | ".join(f"{t[m]:.1f}" for m in ms_list) + f" | {t[8] / t[1]:.2f} |")
    best = {m: min(med, key=lambda n: med[n][m]) for m in ms_list}
    print("| cheapest | | " + " | ".join(best[m] for m in ms_list) + " | |")
    print(f"\nauto, plain decoding: {plain}\nauto, k = 8 drafts: {spec}")


if __name__ == "__main__":
    main()
