"""Prefix caching with a learned drafter: time to first token of the later turns of a conversation, with the cache
on against off, the same drafter, the same requests, outputs compared.

Two workloads, each a sequence of turns whose prompt repeats everything before it:
  mt-bench    the second turns of MT-bench (Spec-Bench's question.jsonl, the eight categories with two turns; fetch it
              yourself: hemingkx/Spec-Bench, data/spec_bench/question.jsonl): turn 1, then turn 2 with turn 1's
              answer in its prompt; TTFT of turn 2;
  agent_loop  the shipped agent-loop workload (six sessions of a tool-calling agent, four turns each, every turn's
              prompt the session so far); TTFT of turns 2-4.
Per conversation the two arms run back to back, their order alternating; the cached arm's prefix cache is emptied
before each conversation, so its first turn prefills everything as the other arm's does, and a later turn hits
what its own earlier turns computed (the prompt, and the answers: a finished request names its output blocks).
Metric: TTFT (request start to first output token, in process, concurrency 1, greedy); per turn the ratio off / on;
geometric mean and median per workload. Every output of the cached arm is compared with the uncached arm's.

  python benchmarks/prefix_ttft.py --questions /tmp/question.jsonl --drafter eagle3 --per-category 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from math import exp, log


def _mt_bench(path: str, per_category: int) -> list[list[str]]:
    """The user turns of MT-bench's two-turn questions, the first `per_category` of each category."""
    seen: dict[str, int] = {}
    out = []
    for line in open(path, encoding="utf-8"):
        q = json.loads(line)
        if len(q.get("turns", [])) < 2 or seen.get(q["category"], 0) >= per_category:
            continue
        seen[q["category"]] = seen.get(q["category"], 0) + 1
        out.append(list(q["turns"][:2]))
    return out


def _agent_sessions(limit: int | None) -> list[list[list[dict]]]:
    """The agent loop's sessions, each its turns' whole message lists, in order."""
    from verispec.bench.workloads import load_workload

    sessions: dict[str, list[list[dict]]] = {}
    for p in load_workload("agent_loop"):
        sessions.setdefault(p.id.rsplit("-t", 1)[0], []).append(list(p.messages))
    return list(sessions.values())[:limit]


def _conversation(llm, turns, sp, answers_from_model: bool) -> list[tuple[float, list[int], float]]:
    """Run one conversation: (TTFT s, output ids, prefix-hit share of the prompt) per turn. `turns`: user strings
    (each turn's prompt: the earlier turns with this arm's own answers) or whole message lists (as given)."""
    out, messages = [], []
    for t in turns:
        if answers_from_model:
            messages = messages + [{"role": "user", "content": t}]
        else:
            messages = t
        hits0, queried0 = llm.cache.prefix_hits, llm.cache.prefix_queries
        o = llm.chat([messages], sp, use_tqdm=False)[0]
        queried = llm.cache.prefix_queries - queried0
        out.append((o.stats["ttft_s"], o.token_ids, (llm.cache.prefix_hits - hits0) / queried if queried else 0.0))
        if answers_from_model:
            messages = messages + [{"role": "assistant", "content": o.text}]
    return out


def _geomean(xs: list[float]) -> float:
    return exp(sum(map(log, xs)) / len(xs)) if xs else float("nan")


def run(args: argparse.Namespace) -> int:
    from verispec import LLM, SamplingParams
    from verispec.bench.load import MachineLoad

    spec = {"method": args.drafter, "num_speculative_tokens": args.k}
    arms = {name: LLM(args.model, dtype="auto", device="cpu", max_model_len=4096, max_num_seqs=1, progress=False,
                      speculative_config=spec, enable_prefix_caching=on, scheduler=args.scheduler)
            for name, on in (("on", True), ("off", False))}
    for llm in arms.values():
        _ = llm.costs  # the start-up profile, before anything is timed
    print(arms["on"].path_choice.describe(), flush=True)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    work: list[tuple[str, list, bool]] = []
    if args.questions:
        work += [("mt-bench", q, True) for q in _mt_bench(args.questions, args.per_category)]
    work += [("agent_loop", s, False) for s in _agent_sessions(args.sessions)]
    ratios: dict[str, list[float]] = {}
    ttft: dict[str, dict[str, list[float]]] = {}
    hit_share: dict[str, list[float]] = {}
    same = total = 0
    load = MachineLoad().start()
    for i, (name, turns, answers_from_model) in enumerate(work):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        got = {}
        for arm in order:
            arms["on"].reset_prefix_cache()
            got[arm] = _conversation(arms[arm], turns, sp, answers_from_model)
        for t, ((t_on, ids_on, hits), (t_off, ids_off, _)) in enumerate(zip(got["on"], got["off"])):
            total += 1
            same += ids_on == ids_off
            if t == 0:
                continue  # the first turn has nothing cached in either arm
            ratios.setdefault(name, []).append(t_off / t_on)
            ttft.setdefault(name, {"on": [], "off": []})
            ttft[name]["on"].append(t_on)
            ttft[name]["off"].append(t_off)
            hit_share.setdefault(name, []).append(hits)
            print(f"{name} {i} turn {t + 1}: TTFT off {t_off * 1e3:.1f} ms, on {t_on * 1e3:.1f} ms, x{t_off / t_on:.2f}, "
                  f"{100 * hits:.0f}% of the prompt hit, {'same' if ids_on == ids_off else 'DIFFERENT'}", flush=True)
    load.stop()
    print(f"\nconditions: concurrency 1 (in process), greedy, {args.max_tokens} tokens per turn; drafter {args.drafter} "
          f"(k {args.k}, scheduler {args.scheduler}) in both arms; metric: TTFT, request start to first output token; "
          f"baseline: the same drafter with prefix caching off, same requests, run back to back (order alternating)"
          f"\n{load.describe()}\n")
    print("| workload | turns | TTFT off (median ms) | TTFT on (median ms) | off / on (geomean) | off / on (median) | "
          "prompt hit (median) |\n|---|---|---|---|---|---|---|")
    for name, rs in ratios.items():
        print(f"| {name} | {len(rs)} | {statistics.median(ttft[name]['off']) * 1e3:.1f} | "
              f"{statistics.median(ttft[name]['on']) * 1e3:.1f} | x{_geomean(rs):.2f} | x{statistics.median(rs):.2f} | "
              f"{100 * statistics.median(hit_share[name]):.0f}% |")
    print(f"\noutputs identical with the cache on and off: {same}/{total} turns")
    return 0 if same == total else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--questions", help="Spec-Bench's question.jsonl (MT-bench second turns); without it, the agent "
                                       "loop only")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--sessions", type=int, default=None, help="agent-loop sessions (default: all six)")
    p.add_argument("--drafter", default="eagle3", help="eagle3, dflash or dspark (the shipped drafter for the model)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--scheduler", default="dspark")
    p.add_argument("--max-tokens", type=int, default=128)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
