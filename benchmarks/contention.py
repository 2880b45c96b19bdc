"""Plain decode beside another process: the thread governor on (`--adaptive-threads`) against off (the default),
on the default model.

A forward on 2 threads waits at every barrier for its slower thread; a busy process at the same priority holds
one of the two cores half the time, so both configurations slow down, the fixed 2-thread one most. Phases
alternate: alone, then beside `--hogs` busy loops (`python -c "while True: pass"`, at `--nice`), `--rounds` times;
in each phase the two LLMs (governor on and off, same model, same path) decode in turn.

Conditions: concurrency 1 (one greedy request of `--max-tokens` tokens, `ignore_eos`); metric = output tokens per
second of the whole request; baseline = the same request with `adaptive_threads=False`, interleaved in the same
phase; median (per-round values) over `--rounds`. The governor keeps its state across requests and phases, so the
"alone" phases after the first also show how fast it comes back after contention ends.

    python benchmarks/contention.py --hogs 1 --nice 0 --rounds 3 --max-tokens 512
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from verispec import LLM, SamplingParams

HOG = "while True: pass"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hogs", type=int, default=1)
    ap.add_argument("--nice", type=int, default=0, help="the busy loops' niceness")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()
    on = LLM(progress=False, adaptive_threads=True)
    off = LLM(progress=False, adaptive_threads=False)
    print(f"path {on.path_choice.path.name}; governor: {on.adaptive_threads} threads at most (on), off: fixed")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    def tok_s(llm: LLM) -> float:
        t = time.perf_counter()
        llm.generate(["1, 2, 3, 4, 5,"], params, use_tqdm=False)
        return args.max_tokens / (time.perf_counter() - t)

    tok_s(on), tok_s(off)  # warm-up
    res: dict[str, list[float]] = {k: [] for k in ("alone on", "alone off", "busy on", "busy off")}
    for _ in range(args.rounds):
        res["alone on"].append(tok_s(on))
        res["alone off"].append(tok_s(off))
        hogs = [subprocess.Popen(["nice", "-n", str(args.nice), sys.executable, "-c", HOG]) for _ in range(args.hogs)]
        try:
            time.sleep(0.3)
            res["busy on"].append(tok_s(on))
            res["busy off"].append(tok_s(off))
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        time.sleep(0.3)
    print(f"\n{args.hogs} busy loop(s) at nice {args.nice}; {args.max_tokens} tokens; {args.rounds} rounds\n")
    print("| phase | governor on tok/s | off tok/s | on / off |\n|---|---|---|---|")
    for phase in ("alone", "busy"):
        a, b = res[f"{phase} on"], res[f"{phase} off"]
        r = [x / y for x, y in zip(a, b)]
        print(f"| {phase} | {statistics.median(a):.1f} ({min(a):.0f}..{max(a):.0f}) | {statistics.median(b):.1f} "
              f"({min(b):.0f}..{max(b):.0f}) | x{statistics.median(r):.2f} ({min(r):.2f}..{max(r):.2f}) |")


if __name__ == "__main__":
    main()
