"""`verispec bench drafters`: learned drafters on the shipped workloads: tau per workload, single-stream speed vs plain, identity, and DSpark's
calibration measured online (expected calibration error of its survival predictions against what verification did).

Conditions (docs/measuring.md): concurrency 1; metrics = tau (mean tokens committed per verification step, bonus included)
and output tok/s of one stream (whole request, prefill included); baseline = speculation off on the same target,
dtype, prompts and run, interleaved (order rotated per prompt); drafters verify a fixed K (static scheduler) so tau
is the drafter's own, unless --scheduler says otherwise. Where a step's time goes: the engine's own split of each
request (stats draft_s and forward_s over its steps, the prefill step included), as ms per step; a learned drafter
pays only when tau exceeds (draft + target forward per step) / plain's forward per step.

    verispec bench drafters --drafters eagle3:DIR,dflash:DIR,dspark:DIR --dtype bfloat16 --limit 3
    verispec bench drafters --drafters suffix,eagle3,suffix+eagle3 --k 7   # a hybrid beside its sides
    verispec bench drafters --drafters eagle3,eagle3@blind --scheduler dspark   # confidences withheld
    verispec bench drafters --drafters eagle3@q8_0,eagle3@q4_1,eagle3@q4_0 --scheduler dspark

A drafter named with `@q8_0`, `@q4_1` or `@q4_0` has its linears rounded to that GGUF block format beside a
gguf-q8act target (speculative_config "quantization"; without one, the default): formats side by side, e.g.
`--drafters eagle3@q8_0,eagle3@q4_0`.

A drafter named with `@blind` has its confidences withheld (its drafts carry none and it does not stop early), as
EAGLE-3, draft models and MTP layers drafted before they gave confidences: the policy then works from its online
estimate alone. The online calibration (ECE) is reported for every drafter whose drafts carry confidences, from
the static scheduler's runs only (there every proposed position is verified).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from typing import Any

from verispec.bench.common import add_common_args
from verispec.bench.workloads import WORKLOADS
from verispec.config import DRAFT_QUANTIZATIONS
from verispec.drafters.base import Draft


class Recorder:
    """Wraps a drafter: keeps (cumulative survival prediction, survived?) for every verified draft position."""

    def __init__(self, inner, pairs: list, blind: bool = False) -> None:
        self.inner, self.pairs, self.last, self.blind = inner, pairs, None, blind
        self.name = inner.name
        self.feature_layers = getattr(inner, "feature_layers", ())
        self.gives_confidence = not blind and getattr(inner, "gives_confidence", True)
        self.drafts_in_one_pass = getattr(inner, "drafts_in_one_pass", False)
        self.stops_early = not blind and getattr(inner, "stops_early", False)

    def propose(self, context, k, **kw):
        d = self.inner.propose(context, k, **kw)
        if self.blind:
            d = Draft(d.tokens, d.probs)
        self.last = d
        return d

    def observe(self, accepted):
        d = self.last
        if d is not None and d.confidence:
            surv = 1.0
            for j, c in enumerate(d.confidence):  # static scheduler: every proposed position was verified
                surv *= c
                self.pairs.append((surv, 1.0 if accepted > j else 0.0))
        self.inner.observe(accepted)

    def add_features(self, feats):
        self.inner.add_features(feats)

    def check_state(self, ref, tokens):
        self.inner.check_state(ref, tokens)

    def release(self, tokens=None):
        self.inner.release(tokens)


def add_drafters_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p, limit=3, max_tokens=128, repeats=1)
    p.add_argument("--drafters", required=True, help="comma list of eagle3:DIR, dflash:DIR, dspark:DIR, ngram")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--k", type=int, default=7, help="draft tokens verified per step")
    p.add_argument("--scheduler", default="static")
    p.add_argument("--json", help="write raw per-run records here")


def build_engines(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, list]]:
    """{name: LLM} with "none" the plain target first, and {name: (predicted survival, survived) pairs} recorded
    for each drafter with confidences under the static scheduler."""
    from verispec.api import LLM
    from verispec.bench.single import method_spec

    base = LLM(args.model, dtype=args.dtype, device=args.device or "cpu", max_model_len=2048, max_num_seqs=1,
               progress=False)
    engines: dict[str, Any] = {"none": base}
    pairs: dict[str, list] = {}
    items = args.drafters.split(",")
    names = [i.split(":", 1)[0] for i in items]
    for item, name in zip(items, names):
        method, *tags = item.split("@")
        blind, rounding = "blind" in tags, [t for t in tags if t in DRAFT_QUANTIZATIONS]
        if set(tags) - {"blind", *rounding}:
            raise SystemExit(f"{item}: a drafter takes @blind and @{'/@'.join(DRAFT_QUANTIZATIONS)}")
        spec = method_spec(method, args.k)
        if rounding:
            spec["quantization"] = rounding[0]
        spec["adaptive"] = args.scheduler != "static"
        e = base.with_speculation(spec)
        e.scheduler = args.scheduler
        key = name if names.count(name) == 1 else item  # two of one method (old and new weights): by path
        if blind and "hybrid" in spec:
            raise SystemExit(f"{item}: @blind is for a drafter alone, not a hybrid")
        if "hybrid" not in spec:  # a hybrid stays itself: the engine gives it a second drafting stage
            new, mine = e.drafters.new, pairs.setdefault(key, []) if args.scheduler == "static" else []
            e.drafters.new = (  # type: ignore[method-assign]
                lambda params, n, _new=new, _p=mine, _b=blind: Recorder(_new(params, n), _p, _b))
        engines[key] = e
        if args.scheduler != "static":
            _ = e.costs
    return engines, pairs


def run_prompts(args: argparse.Namespace, engines: dict[str, Any]) -> list[dict]:
    """One record per (prompt, engine): tok/s, ratio to plain, tau, the step split and identity; the engines' order
    rotated per prompt."""
    from verispec.bench.workloads import load_workload
    from verispec.check.identity import compare_greedy
    from verispec.sampling import SamplingParams

    base, records = engines["none"], []
    for wl in args.workloads.split(","):
        for i, wp in enumerate(load_workload(wl, limit=args.limit)):
            ids = base.tokenizer(base.apply_chat_template(list(wp.messages)), add_special_tokens=False)["input_ids"]
            params = SamplingParams(temperature=0, max_tokens=min(wp.max_tokens, args.max_tokens))
            names = list(engines)
            shift = i % len(names)
            got = {n: engines[n].generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
                   for n in names[shift:] + names[:shift]}
            plain = got["none"]
            for n, out in got.items():
                div = None if n == "none" else compare_greedy(base.model, ids, plain.token_ids, out.token_ids)
                records.append({"workload": wl, "prompt": wp.id, "method": n, "tok_per_s": out.stats["tok_per_s"],
                                "ratio": out.stats["tok_per_s"] / plain.stats["tok_per_s"],
                                "tau": out.stats["mean_acceptance_length"] if n != "none" else 1.0,
                                "draft_ms_per_step": 1e3 * out.stats.get("draft_s", 0.0) / max(1, out.stats["steps"]),
                                "forward_ms_per_step": 1e3 * out.stats["forward_s"] / max(1, out.stats["steps"]),
                                "identical": div is None, "near_tie": bool(div and div.near_tie),
                                "divergence": None if div is None else str(div)})
            print(" ".join(f"{r['method']}:tau={r['tau']:.2f},x{r['ratio']:.2f},{'=' if r['identical'] else '!'}"
                           for r in records[-len(got):]), wp.id, flush=True, file=sys.stderr)
    return records


def print_table(args: argparse.Namespace, records: list[dict], engines: dict[str, Any], load: str) -> None:
    by = defaultdict(list)
    for r in records:
        by[(r["workload"], r["method"])].append(r)
    print(f"dtype {args.dtype}, K = {args.k}, scheduler {args.scheduler}, {args.limit} prompts per workload, "
          f"max {args.max_tokens} tokens, greedy; {load}")
    print("| workload | method | tau (mean) | tok/s (median) | speedup vs plain, median (min..max) | draft / target "
          "forward ms per step (median) | identical |")
    print("|---|---|---|---|---|---|---|")
    for (wl, n), rs in by.items():
        ratios = [r["ratio"] for r in rs]
        split = (f"{statistics.median(r['draft_ms_per_step'] for r in rs):.1f} / "
                 f"{statistics.median(r['forward_ms_per_step'] for r in rs):.1f}")
        print(f"| {wl} | {n} | {statistics.mean(r['tau'] for r in rs):.2f} | "
              f"{statistics.median(r['tok_per_s'] for r in rs):.1f} | x{statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}..{max(ratios):.2f}) | {split} | {sum(r['identical'] for r in rs)}/{len(rs)} |")
    for n in engines:
        if n != "none":
            rs = [r for r in records if r["method"] == n]
            print(f"overall {n}: tau {statistics.mean(r['tau'] for r in rs):.2f}, "
                  f"speedup median x{statistics.median(r['ratio'] for r in rs):.2f}")


def calibration(pairs: dict[str, list]) -> dict[str, dict]:
    """Each drafter's own online calibration (those with confidences, static runs): ECE and means."""
    import torch

    from verispec.train.calibrate import ece

    summary = {}
    for key, got in pairs.items():
        if not got:
            continue
        probs, outcomes = torch.tensor([p for p, _ in got]), torch.tensor([o for _, o in got])
        summary[key] = {"online_ece": float(ece(probs, outcomes)), "positions": len(got),
                        "mean_prediction": float(probs.mean()), "mean_survival": float(outcomes.mean())}
        print(f"{key} online calibration: ECE {summary[key]['online_ece']:.3f} over {len(got)} verified "
              f"positions (mean predicted survival {summary[key]['mean_prediction']:.3f}, observed "
              f"{summary[key]['mean_survival']:.3f})")
    return summary


def run_drafters_cli(args: argparse.Namespace) -> int:
    from verispec.bench.load import MachineLoad

    engines, pairs = build_engines(args)
    load = MachineLoad().start()
    records = run_prompts(args, engines)
    load.stop()
    print(file=sys.stderr)
    print_table(args, records, engines, load.describe())
    summary = calibration(pairs)
    for r in records:
        if r["divergence"]:
            print(f"  {r['method']} {r['prompt']}: {r['divergence']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "records": records, "summary": summary}, f, indent=1)
    return 0
