"""`verispec demo`: the main job on the default model, a short single-stream comparison that a person can read.

Fetches the default model on first use, then runs `bench single` on the first three prompts of each shipped agent
workload: plain decoding against the model-free drafters, greedy, interleaved. Prints the table (output tok/s of one
stream, the median speedup over plain on the same prompt in the same run and its range, tau, identity) and writes
the HTML report (about 20 s on 2 cores). Three prompts, not one: a single prompt shows that prompt more than its
workload (one run: n-gram x0.86-0.93 on three workloads whose first three prompts gave x1.08-1.18).
"""

from __future__ import annotations

import argparse
import sys

from verispec.bench.report import markdown_table, write_report
from verispec.bench.single import method_spec, run_single
from verispec.bench.workloads import WORKLOADS
from verispec.config import MODEL_FREE_METHODS

K = 8  # draft tokens per step, the bench's default
PROMPTS = 3  # per workload: one prompt alone says more about that prompt than about the workload


def run_demo(args: argparse.Namespace) -> int:
    from verispec import LLM

    print(f"verispec demo: loading {args.model} ({args.dtype}) ...", file=sys.stderr, flush=True)
    # dtype="auto" chooses the weight path for the blocks the drafters verify (k = 8, as run_single runs them)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len or 2048,
              max_num_seqs=1, quantization=args.quantization, speculative_config=method_spec(MODEL_FREE_METHODS[0], K),
              invariant=args.invariant)
    rep = run_single(model=args.model, methods=MODEL_FREE_METHODS, workloads=WORKLOADS, limit=PROMPTS, repeats=1,
                     max_tokens=args.max_tokens, llm=llm, k=K)
    paths = write_report(rep, args.out)
    print()
    for k, v in rep.conditions.items():
        print(f"- {k}: {v}")
    print()
    print(markdown_table(rep.tables[0]))
    for n in rep.notes:
        print(f"> {n}")
    print(f"\nHTML report: {paths['html']}")
    return 0
