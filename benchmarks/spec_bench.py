"""Spec-Bench at concurrency 1, in process: each arm against speculation off on the first --per-category questions of
every category of Spec-Bench's question.jsonl (fetch it yourself: hemingkx/Spec-Bench, data/spec_bench/question.jsonl),
interleaved (the arms' order rotates per question and repeat), greedy, every output compared with plain's.

The default arm is verispec's default speculation: n-gram drafts under the dspark scheduler, as `verispec serve
--method ngram` runs it (16 sequences, k = 4; the prefix cache, which the arms share, emptied before every request). Arms: `ngram`, `suffix` (model-free, the serving
defaults), `suffix-nocache` (suffix without the cache of earlier outputs); shared drafter state (the suffix cache,
n-gram survival) is forgotten at the start of each repeat.

--clock cpu: every clock the engine reads (its measured forwards, the policy's cost model, drafting times) and the
metric are the process's CPU time, with one thread: on a machine other jobs load, what the work costs rather than
how long it waited for a core. Ratios then say what a quiet one-core machine would see; state it with the figures.

  python benchmarks/spec_bench.py /tmp/question.jsonl --per-category 3 --repeats 2 --clock cpu
  python benchmarks/spec_bench.py agent_loop --arms suffix,suffix-nocache,ngram   (a shipped workload instead)
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _arm_spec(name: str, k: int) -> dict | None:
    """'ngram' or 'suffix', with options after dashes: '-k8' (8 draft tokens), '-tree' ("draft_tree": "auto"),
    '-nocache' (suffix without the cache of earlier outputs, set up by `run`)."""
    if name == "none":
        return None
    method, *opts = name.split("-")
    spec: dict = {"method": method, "num_speculative_tokens": k}
    for o in opts:
        if o == "tree":
            spec["draft_tree"] = "auto"
        elif o.startswith("k") and o[1:].isdigit():
            spec["num_speculative_tokens"] = int(o[1:])
        elif o != "nocache":
            raise ValueError(f"unknown arm option {o!r} in {name!r}")
    return spec


def run(args: argparse.Namespace) -> int:
    import torch

    from verispec import LLM, SamplingParams
    from verispec.bench.load import MachineLoad
    from verispec.bench.spec_bench import (
        Run,
        load_spec_bench,
        markdown,
        spec_bench_rows,
    )
    from verispec.bench.workloads import load_workload

    if args.clock == "cpu":
        torch.set_num_threads(1)
    if args.questions.endswith(".jsonl") and os.path.isfile(args.questions) and not args.plain_workload:
        cats = args.categories.split(",") if args.categories else None
        sets = load_spec_bench(args.questions, args.per_category, cats, max_tokens=args.max_tokens)
    else:
        sets = {args.questions: load_workload(args.questions, limit=args.per_category)}
    def new_llm():
        return LLM(args.model, dtype="auto", device="cpu", max_model_len=2048, max_num_seqs=args.max_num_seqs,
                   progress=False, enable_prefix_caching=True, scheduler=args.scheduler)

    base = new_llm()
    arms = {"none": base.with_speculation(None)}
    for a in args.arms.split(","):
        # --keep-prefix-cache: each arm its own KV cache, so what one arm cached never serves another
        arms[a] = (new_llm() if args.keep_prefix_cache else base).with_speculation(_arm_spec(a, args.k))
        _ = arms[a].costs  # the start-up profile, before anything is timed
    print(base.path_choice.describe(), flush=True)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    names = list(arms)
    runs: dict[str, list[Run]] = {a: [] for a in names if a != "none"}
    load = MachineLoad().start()
    for rep in range(args.repeats):
        for name, e in arms.items():
            e.drafters.reset_shared()
            e.reset_prefix_cache()  # each repeat starts from an empty cache
            if "-nocache" in name and e.drafters.suffix_cache is not None:
                from verispec.drafters.suffix import SuffixCache, SuffixConfig

                e.drafters.suffix_cache = SuffixCache(SuffixConfig(max_cached_requests=0))
        i = 0
        for cat, prompts in sets.items():
            for p in prompts:
                order = names[(rep + i) % len(names):] + names[:(rep + i) % len(names)]
                i += 1
                got = {}
                for name in order:
                    if not args.keep_prefix_cache:  # the arms share the KV cache: each request prefills its prompt
                        base.reset_prefix_cache()
                    t0 = time.perf_counter()
                    o = arms[name].chat([list(p.messages)], sp, use_tqdm=False)[0]
                    got[name] = (o.token_ids, time.perf_counter() - t0, o.stats)
                plain_ids, plain_s, _ = got["none"]
                for name in runs:
                    ids, s, st = got[name]
                    ratio = (len(ids) / s) / (len(plain_ids) / plain_s)
                    runs[name].append(Run(cat, ratio, st.get("mean_acceptance_length", 1.0), ids == plain_ids))
                    print(f"{cat} {p.id} rep {rep} {name}: x{ratio:.3f} tau {runs[name][-1].tau:.2f} "
                          f"{'same' if ids == plain_ids else 'DIFFERENT'}", flush=True)
    load.stop()
    clock = ("process CPU time, one thread (engine clocks and metric)" if args.clock == "cpu"
             else "wall clock")
    print(f"\nconditions: concurrency 1 (in process); metric: output tokens per second of one request, {clock}, "
          f"ratio to speculation off on the same question and repeat (geometric means); baseline: speculation off, "
          f"same target and weight path; {args.max_tokens} tokens, greedy, {args.repeats} repeat(s), "
          f"max_num_seqs {args.max_num_seqs}, scheduler {args.scheduler}, k {args.k}; prefix cache "
          f"{'kept across requests (each arm its own)' if args.keep_prefix_cache else 'emptied before every request'}"
          f"\n{load.describe()}")
    for name, rs in runs.items():
        cats, tasks = spec_bench_rows(rs)
        print(f"\n### {name} per category\n\n{markdown(cats, 'category')}\n\n### {name} per task\n\n"
              f"{markdown(tasks, 'task')}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("questions", help="Spec-Bench's question.jsonl, or a shipped workload name / JSONL file")
    ap.add_argument("--plain-workload", action="store_true", help="read a .jsonl path as a workload, not Spec-Bench")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--arms", default="ngram", help="comma list of ngram, suffix, suffix-nocache, each with "
                    "options -k8 (draft tokens), -tree (draft trees where they pay)")
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--categories", default=None, help="comma list (default: all 13)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (the default configuration's: 4)")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="the server's default: 16")
    ap.add_argument("--scheduler", default="dspark")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="as a server runs: each arm its own KV cache, prefix caching kept across requests (emptied "
                         "at each repeat); for multi-turn workloads such as agent_loop")
    args = ap.parse_args(argv)
    if args.clock == "cpu":  # before torch and the kernel start their thread pools
        os.environ["OMP_NUM_THREADS"] = "1"
        time.perf_counter = time.process_time  # type: ignore[assignment]  # every clock the engine reads
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
