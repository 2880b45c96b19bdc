"""`verispec audit sweep --rule threshold --values 1.0,0.8,0.6,0.4 --temperature 0,1 [--method ngram] ...`: the
acceptance-threshold sweep (audit/sweep.py) and its report (audit/sweep_report.py); with `--endpoint VALUE=SPEC`
(repeated) one server per value instead (audit/sweep_endpoint.py)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from verispec.audit.spec import AUDIT_MAX_MODEL_LEN, AUDIT_MAX_NUM_SEQS, EngineSpec
from verispec.models.hub import DEFAULT_MODEL


def add_sweep_parser(sub: Any) -> None:
    p = sub.add_parser("sweep", help="one lossy acceptance rule at several values against strict verification: "
                                     "tau, tok/s, relaxed tokens, TV to the target, quality delta per domain")
    p.add_argument("--rule", default="threshold", help="the relaxed rule swept (default: %(default)s)")
    p.add_argument("--values", default=None,
                   help="comma list of values in (0, 1]; 1.0 is strict verification (default: 1.0,0.8,0.6,0.4; "
                        "in process only)")
    p.add_argument("--endpoint", action="append", default=[], metavar="VALUE=SPEC",
                   help="endpoint mode, repeated: the OpenAI-compatible server that serves VALUE, e.g. "
                        "0.8=url=http://host:30001,model=M (one SGLang server per "
                        "--speculative-accept-threshold-single). The in-process options (--method, --k, --drafter, "
                        "--scheduler, --dtype, --quantization, --model, --device, --max-model-len, --max-num-seqs) "
                        "are not used; tau is read from each server's /metrics; relaxed %% and TV are n/a")
    p.add_argument("--reference-endpoint", default=None, metavar="SPEC",
                   help="endpoint mode: the strict-verification server (default: the --endpoint of value 1.0)")
    p.add_argument("--concurrency", type=int, default=8, help="endpoint mode: requests in flight per server")
    p.add_argument("--param", default="threshold_acc", choices=("threshold_acc", "threshold_single", "both"),
                   help="what a value sets: threshold_acc (accept x with probability min(1, p(x) / (value q(x)))), "
                        "threshold_single (also accept whenever p(x) >= value) or both (default: %(default)s)")
    p.add_argument("--method", default="ngram", help="the speculative method (default: %(default)s)")
    p.add_argument("--k", type=int, default=None, help="draft tokens per step (default: the method's)")
    p.add_argument("--drafter", default=None, help="draft model / trained drafter (method draft_model, eagle3, ...)")
    p.add_argument("--scheduler", default="static",
                   help="static, goodput or dspark (default: %(default)s: the same k at every value)")
    p.add_argument("--dtype", default="auto", help="weight path: auto, float32, bfloat16 (default: %(default)s)")
    p.add_argument("--quantization", default=None,
                   help="gguf: the GGUF file's own int4 blocks; gguf-q8act: its blocks on verispec's kernel")
    p.add_argument("--domains", default=None, help="comma list of shipped domains (default: all)")
    p.add_argument("--items", default=None, help="a JSONL of audit items in the shipped format, instead of domains")
    p.add_argument("--temperature", default="0,1", help="comma list of temperatures (default: %(default)s)")
    p.add_argument("--samples", type=int, default=3, help="seeded samples per item at T > 0 (default %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="items per domain (default: all)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap every item's max_tokens")
    p.add_argument("--seed", type=int, default=0, help="base of the per-(item, sample) seeds and of the bootstrap")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default: %(default)s)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=AUDIT_MAX_MODEL_LEN, help="KV positions per request")
    p.add_argument("--max-num-seqs", type=int, default=AUDIT_MAX_NUM_SEQS, help="requests decoding together")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--out", default="verispec-audit-sweep", help="directory for the JSON, CSV, Markdown, PNG, HTML")


def base_spec(args: argparse.Namespace) -> EngineSpec:
    return EngineSpec(method=args.method, k=args.k, drafter=args.drafter, scheduler=args.scheduler,
                      dtype=args.dtype, quantization=args.quantization,
                      adaptive=False if args.scheduler == "static" else None)


def run_sweep_cli(args: argparse.Namespace, temps: list[float], load_items: Callable[[], list]) -> int:
    from verispec.audit.sweep import build_sweep_sides, parse_values, run_sweep, sweep_rows, value_spec
    from verispec.audit.sweep_report import build_sweep_report, publish_sweep_report

    if args.endpoint or args.reference_endpoint:
        from verispec.audit.sweep_endpoint import run_endpoint_sweep_cli

        if args.values is not None:
            raise ValueError("--values is for the in-process sweep; with --endpoint each VALUE=SPEC names its value")
        return run_endpoint_sweep_cli(args, temps, load_items)
    values = parse_values(args.values or "1.0,0.8,0.6,0.4")
    base = base_spec(args)  # bad input fails before any model loads
    value_spec(base, args.rule, args.param, values[0])
    if args.samples < 1 or args.bootstrap < 100 or args.max_num_seqs < 1:
        raise ValueError("need --samples >= 1, --bootstrap >= 100 and --max-num-seqs >= 1")
    items = load_items()
    ref, cands = build_sweep_sides(base, args.rule, args.param, values, args.model, args.device, args.max_model_len,
                                   args.max_num_seqs, progress=not args.quiet)
    records, runs = run_sweep(items, ref, cands, temps, args.samples, args.seed, args.max_tokens,
                              progress=not args.quiet)
    rows, domains = sweep_rows(records, runs, args.bootstrap, args.seed)
    setup = (f"{len(items)} item(s), temperatures {', '.join(f'{t:g}' for t in temps)}, {args.samples} sample(s) "
             f"per item at T > 0, seed {args.seed}, target {args.model}, path {ref.llm.path_choice.path.name}"
             + (f", max_tokens capped at {args.max_tokens}" if args.max_tokens else ""))
    rep = build_sweep_report(records, runs, rows, domains, rule=args.rule, param=args.param,
                             reference=ref.describe(), n_resamples=args.bootstrap, seed=args.seed, setup=setup,
                             concurrency=f"in process, batches of up to {args.max_num_seqs} requests decoding "
                                         "together; the reference, then each value, one after another per temperature")
    return publish_sweep_report(rep, args.out)
