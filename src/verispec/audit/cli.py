"""`verispec audit --candidate SPEC --reference SPEC [--domains ...] [--temperature 0,1] [--samples N] [--limit N]
--out DIR`: paired quality per domain between two configurations (SPEC syntax: audit/spec.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from verispec.audit.spec import AUDIT_MAX_MODEL_LEN, AUDIT_MAX_NUM_SEQS, EndpointSpec, EngineSpec, parse_spec
from verispec.models.hub import DEFAULT_MODEL


def add_audit_args(p: argparse.ArgumentParser) -> None:
    from verispec.audit.sweep_cli import add_sweep_parser

    add_sweep_parser(p.add_subparsers(dest="audit_command", required=False, metavar="{sweep}"))
    p.add_argument("--candidate", default=None,
                   help="SPEC of the side under test: `plain`, engine keys (`method=ngram,k=4,dtype=float32`, or a "
                        "JSON object; keys method, k, drafter, scheduler, rule, threshold_single, threshold_acc, "
                        "dtype, quantization, adaptive, invariant, model, label) or an OpenAI-compatible endpoint "
                        "(`url=http://host:port/v1,model=NAME[,key=KEY]`)")
    p.add_argument("--reference", default=None, help="SPEC of the side compared against (same syntax; both are "
                                                     "required unless the subcommand is `sweep`)")
    p.add_argument("--domains", default=None,
                   help="comma list of shipped domains (front_end, agent, creative, safety, coding; default: all)")
    p.add_argument("--items", default=None, help="a JSONL of audit items in the shipped format, instead of domains")
    p.add_argument("--temperature", default="0,1", help="comma list of temperatures (default: %(default)s)")
    p.add_argument("--samples", type=int, default=3,
                   help="seeded samples per item at each temperature > 0 (temperature 0: one; default %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="items per domain (with --items: the first N; default: all)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap every item's max_tokens")
    p.add_argument("--seed", type=int, default=0, help="base of the per-(item, sample) seeds and of the bootstrap")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default: %(default)s)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="target of in-process SPECs without model= (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda for in-process SPECs (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=AUDIT_MAX_MODEL_LEN, help="KV positions per request, in process")
    p.add_argument("--max-num-seqs", type=int, default=AUDIT_MAX_NUM_SEQS, help="requests decoding together, in process")
    p.add_argument("--concurrency", type=int, default=AUDIT_MAX_NUM_SEQS, help="requests in flight per endpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--out", default="verispec-audit", help="directory for the JSON, CSV, Markdown, PNG and HTML report")


def parse_temperatures(text: str) -> list[float]:
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--temperature takes comma-separated numbers, e.g. 0,1; got {text!r}") from None
    if not temps or any(t < 0 for t in temps):
        raise ValueError(f"--temperature needs numbers >= 0, got {text!r}")
    return list(dict.fromkeys(temps))


def load_audit_items(domains: str | None, items_path: str | None, limit: int | None) -> list[Any]:
    from verispec.audit.items import DOMAINS, load_domain, load_items

    if items_path:
        if domains:
            raise ValueError("give --domains or --items, not both")
        return load_items(items_path, limit)
    names = [d.strip() for d in (domains or ",".join(DOMAINS)).split(",") if d.strip()]
    return [item for name in names for item in load_domain(name, limit)]


def concurrency_text(candidate: Any, reference: Any, args: argparse.Namespace) -> str:
    parts = []
    for name, spec in (("candidate", candidate), ("reference", reference)):
        if isinstance(spec, EndpointSpec):
            parts.append(f"{name}: up to {args.concurrency} requests in flight to the endpoint")
        else:
            parts.append(f"{name}: in process, batches of up to {args.max_num_seqs} requests decoding together")
    return "; ".join(parts) + " (the sides run one after the other, the reference first)"


def run_audit_cli(args: argparse.Namespace) -> int:
    from verispec.audit.report import build_report, write_audit_report
    from verispec.audit.runner import build_sides, run_audit
    from verispec.bench.report import markdown_table

    if getattr(args, "audit_command", None) == "sweep":
        from verispec.audit.sweep_cli import run_sweep_cli

        return run_sweep_cli(args, parse_temperatures(args.temperature),
                             lambda: load_audit_items(args.domains, args.items, args.limit))
    if not args.candidate or not args.reference:
        raise ValueError("verispec audit needs --candidate SPEC and --reference SPEC (or `verispec audit sweep ...`)")
    candidate, reference = parse_spec(args.candidate), parse_spec(args.reference)  # bad input fails first
    temps = parse_temperatures(args.temperature)
    if args.samples < 1 or args.bootstrap < 100 or args.concurrency < 1 or args.max_num_seqs < 1:
        raise ValueError("need --samples >= 1, --bootstrap >= 100, --concurrency >= 1 and --max-num-seqs >= 1")
    items = load_audit_items(args.domains, args.items, args.limit)
    cand_side, ref_side = build_sides(candidate, reference, args.model, args.device, args.max_model_len,
                                      args.max_num_seqs, args.concurrency, progress=not args.quiet)
    records = run_audit(items, cand_side, ref_side, temps, args.samples, args.seed, args.max_tokens,
                        progress=not args.quiet)
    setup = (f"{len(items)} item(s), temperatures {', '.join(f'{t:g}' for t in temps)}, {args.samples} sample(s) "
             f"per item at T > 0, seed {args.seed}"
             + (f", max_tokens capped at {args.max_tokens}" if args.max_tokens else "")
             + (f", in-process target {args.model}" if isinstance(candidate, EngineSpec)
                or isinstance(reference, EngineSpec) else ""))
    rep, _ = build_report(records, candidate=cand_side.describe(), reference=ref_side.describe(),
                          concurrency=concurrency_text(candidate, reference, args), n_resamples=args.bootstrap,
                          seed=args.seed, setup=setup)
    paths = write_audit_report(rep, args.out)
    print(markdown_table(rep.tables[0]))
    print("\n".join(f"> {n}" for n in rep.notes))
    print(f"report: {paths['html']}  (also {paths['md'].name}, {paths['json'].name}, {paths['csv'].name}, "
          f"delta_per_domain.png)", file=sys.stderr)
    return 0
