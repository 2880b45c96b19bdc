"""`verispec demo`: the main job on the default model, a short single-stream comparison that a person can read.

Fetches the default model on first use, then runs `bench single` on one prompt of each shipped agent workload:
plain decoding against the model-free drafters, greedy, interleaved. Prints the table (output tok/s of one stream,
speedup over plain on the same prompt in the same run, tau, identity) and writes the HTML report.
"""

from __future__ import annotations

import argparse
import sys

from verispec.bench.report import markdown_table, write_report
from verispec.bench.single import method_spec, run_single
from verispec.bench.workloads import WORKLOADS
from verispec.config import MODEL_FREE_METHODS

K = 8  # draft tokens per step, the bench's default


def run_demo(args: argparse.Namespace) -> int:
    from verispec import LLM

    print(f"verispec demo: loading {args.model} ({args.dtype}) ...", file=sys.stderr, flush=True)
    # dtype="auto" chooses the weight path for the blocks the drafters verify (k = 8, as run_single runs them)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len or 2048,
              max_num_seqs=1, quantization=args.quantization, speculative_config=method_spec(MODEL_FREE_METHODS[0], K),
              invariant=args.invariant)
    rep = run_single(model=args.model, methods=MODEL_FREE_METHODS, workloads=WORKLOADS, limit=1, repeats=1,
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
