"""A float16 KV cache against the float32 one: what a decode step costs, what serving gains, how outputs change.

Conditions (MEASURE.md): one process, the default model on `dtype="auto"`, two engines that differ only in
`kv_cache_dtype` (float32 / float16), run interleaved (order alternating per repeat).
- Step cost: one forward of S sequences x 1 new row after C committed positions each (the decode step of S
  concurrent requests), median ms of `--repeats` forwards per arm; S = 1 and 16, C = 128, 512, 1536.
- Serving: closed loop at concurrency 1 and 16 over the shipped workloads mixed (4 requests per slot), greedy,
  `--max-tokens`, speculation off; aggregate output tok/s per repeat, ratio float16 / float32 paired per repeat.
- Outputs: greedy answers to the first `--limit` prompts of every shipped workload under both caches: how many are
  identical, and where the first difference falls.
Baseline: the float32 cache, same prompts, same run.

    python benchmarks/studies/kv_dtype.py [--repeats 9] [--max-tokens 64] [--limit 6]      (about 4 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import LLM, SamplingParams
from verispec.bench.common import prompt_pool
from verispec.bench.load import MachineLoad
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.models.llama import Segment


def step_ms(llm: LLM, S: int, C: int, repeats: int) -> list[float]:
    """Forwards of S sequences x 1 row after C positions each (a fresh cache of the engine's dtype)."""
    m = llm.model
    cache = m.new_cache(C + 1, num_slots=S)
    slots = [cache.allocate() for _ in range(S)]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for s in slots:
            m.prefill(torch.randint(100, 40000, (C,), generator=g), cache, s)
        out = []
        for _ in range(repeats):
            ids = torch.randint(100, 40000, (S,), generator=g)
            t = time.perf_counter()
            m(ids, [Segment(s, C, 1) for s in slots], cache, logits_indices=range(S))
            out.append((time.perf_counter() - t) * 1e3)
            for s in slots:
                cache.rollback(s, C)
    return out


def serve(llm: LLM, conc: int, pool) -> float:
    llm.configure_engine(max_num_seqs=conc)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in pool], [p for _, p in pool], use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=6, help="prompts per workload for the output comparison")
    args = ap.parse_args(argv)

    arms = {name: LLM(args.model, max_model_len=2048, max_num_seqs=16, progress=False, kv_cache_dtype=name)
            for name in ("float32", "float16")}
    names = list(arms)
    load = MachineLoad().start()
    print(f"## KV cache float16 against float32: {args.model}, {arms['float32'].path_choice.path.name}\n")
    print("| sequences x context | float32 ms | float16 ms | float16 / float32 |\n|---|---|---|---|")
    for S in (1, 16):
        for C in (128, 512, 1536):
            got: dict[str, list[float]] = {n: [] for n in names}
            for r in range(3):
                for n in (names if r % 2 == 0 else names[::-1]):
                    got[n] += step_ms(arms[n], S, C, max(1, args.repeats // 3))
            a, b = statistics.median(got["float32"]), statistics.median(got["float16"])
            print(f"| {S} x {C} | {a:.2f} | {b:.2f} | x{b / a:.2f} |", flush=True)

    print("\n| concurrency | float32 tok/s (per repeat) | float16 tok/s (per repeat) | float16 / float32 (median, "
          "range) |\n|---|---|---|---|")
    for conc in (1, 16):
        pool = prompt_pool(arms["float32"], max(4, 4 * conc), args.max_tokens)
        got = {n: [] for n in names}
        for r in range(max(2, args.repeats // 3)):
            for n in (names if r % 2 == 0 else names[::-1]):
                got[n].append(serve(arms[n], conc, pool))
        ratios = [b / a for a, b in zip(got["float32"], got["float16"])]
        print(f"| {conc} | {', '.join(f'{x:.1f}' for x in got['float32'])} | "
              f"{', '.join(f'{x:.1f}' for x in got['float16'])} | x{statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}..{max(ratios):.2f}) |", flush=True)

    same, firsts, total = 0, [], 0
    for w in WORKLOADS:
        for wp in load_workload(w, limit=args.limit):
            params = SamplingParams(temperature=0.0, max_tokens=min(args.max_tokens, wp.max_tokens))
            a, b = (arms[n].chat([list(wp.messages)], params, use_tqdm=False)[0].token_ids for n in names)
            total += 1
            if a == b:
                same += 1
            else:
                firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    load.stop()
    print(f"\nGreedy outputs identical under both caches: {same}/{total}"
          + (f"; first difference at token {sorted(firsts)}" if firsts else "") + f"\n\n{load.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
