"""A decode step on the thread that built the engine against one on the server's worker thread.

The server builds the LLM on its main thread (the path choice and step-cost profiles run kernels there) and steps
it on a `BackgroundEngine` worker. OpenMP keeps a thread pool per thread that ran a parallel region, so the main
thread's pool outlives the hand-over; with more OpenMP threads than CPUs libgomp stops spinning at barriers
(kernels/threads.py). `BackgroundEngine.start()` now releases the starting thread's pool first.

Arms, one process, one LLM (the default model, `dtype="auto"`, one sequence at a time), run interleaved with the
order rotated per repeat:
  main             `LLM.generate` on the main thread
  worker           a `BackgroundEngine` started from the main thread (releases the main thread's pool: the default)
  worker-no-release  the same with the release skipped (the old behaviour; the main thread's pool made first)
Conditions: concurrency 1, the first --prompts chat prompts of the shipped workload, greedy, --max-tokens tokens,
--repeats repeats. Metric: the engine's own step clock, ms of target forward per step, and wall ms per output token,
median over repeats of each arm's mean over its prompts. Baseline: the main arm, same run.

    python benchmarks/studies/worker_thread.py [--prompts 4] [--max-tokens 64] [--repeats 3]     (about 1 minute)
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from unittest import mock

import torch

from verispec import LLM, SamplingParams
from verispec.bench.load import MachineLoad
from verispec.bench.workloads import load_workload
from verispec.engine import background
from verispec.kernels.cpu import cpu_info
from verispec.models.hub import DEFAULT_MODEL

ARMS = ("main", "worker", "worker-no-release")


def run_arm(llm: LLM, arm: str, prompts: list[list[int]], sp: SamplingParams) -> tuple[float, float]:
    """(forward ms per step, wall ms per output token) of one arm over the prompts."""
    e = llm.engine
    s0, f0, t0, n = e.clock.steps, e.clock.seconds["forward"], time.perf_counter(), 0
    if arm == "main":
        n = sum(len(o.token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                       use_tqdm=False))
    else:
        (torch.arange(4_000_000, dtype=torch.float64) * 2).sum()  # the main thread's pool, as after a build
        skip = mock.patch.object(background, "release_openmp_threads", lambda: 0) if arm != "worker" else nullcontext()
        with skip:
            bg = background.BackgroundEngine(e, llm.check_prompt_ids)
            bg.start()
        try:
            for p in prompts:
                n += sum(len(ev.token_ids) for ev in bg.submit(p, sp).events(timeout=600))
        finally:
            bg.shutdown()
    steps = e.clock.steps - s0
    return (e.clock.seconds["forward"] - f0) / steps * 1e3, (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(DEFAULT_MODEL, progress=False, max_num_seqs=1)
    chat = load_workload("chat")
    prompts = [llm.tokenizer(llm.apply_chat_template(list(chat[i].messages)), add_special_tokens=False)["input_ids"]
               for i in range(args.prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    run_arm(llm, "main", prompts[:1], sp)  # warm-up
    load = MachineLoad()
    load.start()
    got: dict[str, list[tuple[float, float]]] = {a: [] for a in ARMS}
    for r in range(args.repeats):
        for arm in ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]:
            got[arm].append(run_arm(llm, arm, prompts, sp))
    load.stop()
    print(f"{llm.path_choice.path.name} on {cpu_info().label()}, torch threads {torch.get_num_threads()}; "
          f"{args.prompts} chat prompts x {args.max_tokens} tokens, {args.repeats} repeats interleaved")
    print(load.describe("nothing else of ours runs here"))
    print("| arm | forward ms / step | wall ms / token | forward vs main |")
    print("|---|---|---|---|")
    base = statistics.median(f for f, _ in got["main"])
    for arm in ARMS:
        f = statistics.median(x for x, _ in got[arm])
        w = statistics.median(x for _, x in got[arm])
        print(f"| {arm} | {f:.2f} | {w:.2f} | x{f / base:.2f} |")


if __name__ == "__main__":
    main()
