"""What a shipped learned drafter would have to accept to run 1.5x plain on chat and code, and what training that
would take by its learning curve (issue 14's speed target; the cards carry the answer where it is missed).

Each drafter runs at a fixed K = 2 and K = `--k` (static scheduler: every step drafts K, so its per-position
survival is its own) beside plain decoding, interleaved per prompt (order rotated). From those runs: the prefill
and a plain decode step (plain's runs), the rest of a speculative step besides the target forward (drafting,
verification, commit) as a line through its two K, and the forward over m = 1..K + 1 rows as the plain step's
forward and the K run's, the profile's shape between them (`profile_costs`, measured before and after the
runs). `train/speed_target.py` then gives the best k's speed ratio and the least improvement reaching the goal
(each position's conditional miss rate scaled down alike). The model is checked against the measured ratios:
the rest of a step is fitted through both runs, so at K = 2 the check is of the survival's first positions (taken
from the K run) and the forward's interpolation, at K of the survival's sum against the run's own tau. The tau
the goal needs at K is turned into training by the card's own learning curve, the held-out estimate asked for the
same rise (its offset read from the card's "--offset N"); an extrapolation, said so.

Conditions (MEASURE.md): concurrency 1, in process, the default model on `dtype auto`, shipped drafters as the
engine runs them (their default block format), greedy, `--limit` prompts per workload run `--repeats` times, at
most `--max-tokens` tokens; metric: output tok/s of one request (prefill included); baseline: plain decoding of
the same prompt in the same run (ratios: the pooled times per workload). Every output is checked identical to
plain's.

    python benchmarks/studies/speed_target.py                  # the table and each card's section (about 3 minutes)
    python benchmarks/studies/speed_target.py --write-cards    # and the section put into the shipped cards
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from verispec import LLM, SamplingParams
from verispec.bench.interleave import run_interleaved
from verispec.bench.load import MachineLoad
from verispec.bench.single import method_spec
from verispec.bench.workloads import load_workload
from verispec.drafters import shipped
from verispec.kernels.cpu import cpu_info
from verispec.engine.profile import profile_costs
from verispec.train.card import SPEED_HEADING, put_section
from verispec.train.curve import curve_points, extrapolate
from verispec.train.shards import read_meta
from verispec.train.speed_target import StreamCosts, speed_goal, speedup, tau


class Pool:
    """Sums over one arm's requests on one workload."""

    def __init__(self) -> None:
        self.prefill = self.decode = self.forward = 0.0
        self.n = self.steps = self.tokens = self.identical = 0
        self.survival: list[float] = []

    def add(self, stats: dict, identical: bool) -> None:
        self.n += 1
        self.prefill += stats["ttft_s"]
        self.decode += stats["e2e_s"] - stats["ttft_s"]
        self.steps += stats["steps"]
        self.forward += stats["forward_s"]
        self.tokens += stats["output_tokens"] - 1
        s = stats.get("per_position_acceptance") or []
        if len(self.survival) < len(s):
            self.survival += [0.0] * (len(s) - len(self.survival))
        for j, a in enumerate(s):  # weighted by steps: pooled over the requests
            self.survival[j] += a * stats["steps"]
        self.identical += identical

    @property
    def step(self) -> float:
        return self.decode / self.steps

    @property
    def survival_mean(self) -> list[float]:
        return [s / self.steps for s in self.survival]

    @property
    def time(self) -> float:
        return self.prefill + self.decode


def card_offset(directory: Path) -> float:
    """The positions trained before the card's run, as its learning-curve section states them (--offset N)."""
    m = re.search(r"--offset (\d+)", (directory / "README.md").read_text())
    return float(m.group(1)) if m else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="eagle3,dflash,dspark", help="learned methods (their shipped drafters)")
    ap.add_argument("--workloads", default="chat,code")
    ap.add_argument("--limit", type=int, default=10, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="runs over the prompts, pooled")
    ap.add_argument("--k", type=int, default=7, help="the longer fixed draft length (the cards' K)")
    ap.add_argument("--goal", type=float, default=1.5)
    ap.add_argument("--write-cards", action="store_true", help="put the section into the shipped drafters' cards")
    ap.add_argument("--json", help="write the pooled measurements here")
    args = ap.parse_args(argv)
    if args.k <= 2:
        raise SystemExit("--k must be above 2 (the other fixed length)")

    base = LLM("smollm2-135m-instruct", device="cpu", max_model_len=2048, max_num_seqs=1, progress=False)
    methods = args.drafters.split(",")
    engines = {"plain": base}
    for m in methods:
        for k in (2, args.k):
            engines[f"{m} K={k}"] = base.with_speculation({**method_spec(m, k), "adaptive": False})
    shapes = [profile_costs(base.model, range(1, args.k + 2), repeats=15)]
    pools: dict[tuple[str, str], Pool] = defaultdict(Pool)
    load = MachineLoad().start()
    for wl in args.workloads.split(","):
        prompts = [dataclasses.replace(wp, max_tokens=min(wp.max_tokens, args.max_tokens))
                   for wp in load_workload(wl, args.limit)]
        print(f"{wl}: {len(prompts)} prompts x {args.repeats} repeats, {len(engines)} arms", file=sys.stderr,
              flush=True)
        runs = run_interleaved(engines, prompts, SamplingParams(temperature=0), args.repeats, own_length=True)
        for name, arm in runs.items():
            for run in arm:
                pools[(wl, name)].add(run.stats, run.identical)
    path = runs["plain"][0].stats["path"]
    load.stop()
    shapes.append(profile_costs(base.model, range(1, args.k + 2), repeats=15))
    shape = [statistics.median(s(m) for s in shapes) for m in range(1, args.k + 2)]

    print(f"\nconcurrency 1, in process, default model on dtype auto ({path}), greedy, {args.limit} prompts per "
          f"workload x {args.repeats} repeats, at most {args.max_tokens} tokens; {load.describe()}")
    print(f"| drafter | workload | measured x K=2 / K={args.k} | model x K=2 / K={args.k} | tau K={args.k} measured / "
          f"from survival | best k now | x{args.goal:g} needs | identical |")
    print("|---|---|---|---|---|---|---|---|")
    sections: dict[str, list[str]] = defaultdict(list)
    record = []
    for m in methods:
        d = shipped.resolve(shipped.shipped_for(m, "smollm2-135m-instruct"))  # the card's curve and offset
        log = json.loads((d / "train_log.json").read_text())
        data_tokens = read_meta(log["data"])["response_tokens"] if Path(log.get("data", "")).joinpath(
            "meta.json").exists() else None
        offset = card_offset(d)
        for wl in args.workloads.split(","):
            plain, short, long_ = pools[(wl, "plain")], pools[(wl, f"{m} K=2")], pools[(wl, f"{m} K={args.k}")]
            f1, fk = plain.forward / plain.steps, long_.forward / long_.steps
            forward = tuple(f1 + (fk - f1) * (shape[i] - shape[0]) / (shape[-1] - shape[0]) for i in range(args.k + 1))
            r2, rk = short.step - forward[2], long_.step - forward[args.k]  # the rest of a step at K = 2 and K
            per = (rk - r2) / (args.k - 2)
            costs = StreamCosts(prefill=plain.prefill / plain.n, plain=plain.step, forward=forward, rest=r2 - 2 * per,
                                rest_per_token=per, tokens=plain.tokens / plain.n)
            surv = long_.survival_mean[:args.k]
            goal = speed_goal(surv, costs, args.goal)
            measured = (plain.time / short.time, plain.time / long_.time)
            model = (speedup(surv, costs, 2), speedup(surv, costs, args.k))
            same = short.identical + long_.identical
            if goal.lam is None:
                need = "unreachable at these costs"
            elif goal.reached:
                need = "reached"
            else:
                need = f"tau {goal.tau_needed:.2f} (k = {goal.k}; misses x{goal.lam:.2f})"
            print(f"| {m} | {wl} | x{measured[0]:.2f} / x{measured[1]:.2f} | x{model[0]:.2f} / x{model[1]:.2f} | "
                  f"{long_.tokens / long_.steps:.2f} / {tau(surv, args.k):.2f} | k = {goal.now_k}: "
                  f"x{goal.now_ratio:.2f} | {need} | {same}/{short.n + long_.n} |")
            sentence = (f"- {wl}: measured x{measured[0]:.2f} / x{measured[1]:.2f} of plain at K = 2 / {args.k} (the "
                        f"model x{model[0]:.2f} / x{model[1]:.2f}; tau {goal.tau_now:.2f} at K = {args.k}); the "
                        f"model's best k is {goal.now_k} at x{goal.now_ratio:.2f}")
            if goal.lam is None:
                sentence += f"; not even drafts that always survive reach x{args.goal:g} at these step costs."
            elif goal.reached:
                sentence += f"; x{args.goal:g} is reached."
            else:
                rise = goal.tau_needed - goal.tau_now
                end = curve_points(log, m)[-1][1]  # the curve's last held-out estimate
                ex = extrapolate(log, m, round(end + rise, 2), offset, data_tokens)
                sentence += (f"; x{args.goal:g} needs tau {goal.tau_needed:.2f} at K = {args.k} (+{rise:.2f}; drafting "
                             f"k = {goal.k}, every position's misses x{goal.lam:.2f}). The learning curve asked for "
                             f"the same rise ({ex.reached:.2f} -> {ex.target:.2f}): "
                             + (f"{ex.cost()} at its {ex.fit.per_doubling:+.3f} per doubling." if ex.positions
                                else "its tail does not rise, so more of the same training does not get there."))
            sections[m].append(sentence)
            record.append({"method": m, "workload": wl, "costs": vars(costs), "survival": surv,
                           "measured": measured, "model": model, "goal": vars(goal)})
    intro = (f"What x{args.goal:g} of plain output tok/s on chat and code would take ({datetime.date.today()}, "
             f"{cpu_info().model}, {torch.get_num_threads()} threads, the default path {path}; concurrency 1, "
             f"greedy, {args.limit} prompts each x {args.repeats} repeats, at most {args.max_tokens} tokens; "
             f"{load.describe()}; `python benchmarks/studies/speed_target.py`): this drafter at fixed K = 2 and {args.k} "
             "beside plain decoding of the same prompts, the step costs measured there and the forward's shape by "
             "rows profiled, a better drafter modelled as this one with every position's conditional miss rate "
             "scaled down alike (train/speed_target.py), and the tau that needs turned into training by this card's "
             "learning curve (the held-out estimate asked for the same rise as the workload's tau: an assumption, "
             "and an extrapolation far past the measured range).")
    for m, lines in sections.items():
        text = "\n".join([SPEED_HEADING, "", intro, "", *lines])
        print("\n" + text)
        if args.write_cards:
            card = shipped.resolve(shipped.shipped_for(m, "smollm2-135m-instruct")) / "README.md"
            put_section(card, SPEED_HEADING, text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "shape": shape, "records": record}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
