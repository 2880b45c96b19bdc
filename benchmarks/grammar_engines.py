"""xgrammar against llguidance on one tokenizer: tokenizer set-up, compile time per JSON schema, mask time per token.

For each schema of the structured workload (benchmarks/structured_cases.py) a valid instance is tokenized; each
engine compiles the schema (a fresh compile: llguidance validates and builds a matcher, xgrammar compiles with its
cache cleared) and then fills the next-token mask before every token of the instance. Reports the median and 95th
percentile over schemas (compile) and over all tokens (mask), and the first mask after a compile separately (where
lazy work lands). Run where both are installed, e.g.
    pip install llguidance; pip install --target /tmp/xgr --no-deps xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xgr nice -n 10 python benchmarks/grammar_engines.py
(xgrammar's own dependency on triton is only for its GPU kernels; the CPU mask does not load it.)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from structured_cases import CASES  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_llguidance(tok, instances, schemas) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    from verispec.sampling.grammar import JSON_OPTIONS

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    setup = time.perf_counter() - t0
    compiles, first, masks = [], [], []
    bm = lt.allocate_token_bitmask(1, lltok.vocab_size)
    for schema, ids in zip(schemas, instances):
        t0 = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        err = llguidance.LLMatcher.validate_grammar(g, lltok)
        m = llguidance.LLMatcher(lltok, g, log_level=0)
        compiles.append(time.perf_counter() - t0)
        assert not err, err
        for i, t in enumerate(ids):
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, bm, 0)
            (first if i == 0 else masks).append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
    return {"setup_s": setup, "compile": compiles, "first_mask": first, "mask": masks}


def run_xgrammar(tok, instances, schemas) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0
    compiles, first, masks = [], [], []
    bm = xgr.allocate_token_bitmask(1, info.vocab_size)
    for schema, ids in zip(schemas, instances):
        t0 = time.perf_counter()
        cg = comp.compile_json_schema(json.dumps(schema), any_whitespace=False)
        m = xgr.GrammarMatcher(cg)
        compiles.append(time.perf_counter() - t0)
        for i, t in enumerate(ids):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm, 0)
            (first if i == 0 else masks).append(time.perf_counter() - t0)
            assert m.accept_token(t), (schema, t)
    return {"setup_s": setup, "compile": compiles, "first_mask": first, "mask": masks}


def summary(name: str, r: dict) -> str:
    ms = lambda xs, q: pct(xs, q) * 1e3  # noqa: E731
    us = lambda xs, q: pct(xs, q) * 1e6  # noqa: E731
    return (f"| {name} | {r['setup_s']:.2f} | {ms(r['compile'], 0.5):.2f} | {ms(r['compile'], 0.95):.2f} | "
            f"{us(r['first_mask'], 0.5):.0f} | {us(r['mask'], 0.5):.1f} | {us(r['mask'], 0.95):.1f} | "
            f"{max(r['mask']) * 1e3:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="llguidance,xgrammar")
    args = ap.parse_args()
    from verispec.models.hub import DEFAULT_MODEL
    from verispec.models.loader import load_tokenizer, resolve

    tok = load_tokenizer(resolve(DEFAULT_MODEL, progress=False))
    schemas = [c["schema"] for c in CASES]
    instances = [tok(json.dumps(c["example"]), add_special_tokens=False)["input_ids"] for c in CASES]
    print(f"{len(schemas)} schemas, {sum(map(len, instances))} tokens, vocabulary {len(tok)}, {platform.processor()}")
    print("| engine | tokenizer set-up s | compile ms p50 | compile ms p95 | first mask us p50 | mask us p50 | "
          "mask us p95 | mask ms max |")
    print("|---|---|---|---|---|---|---|---|")
    runners = {"llguidance": run_llguidance, "xgrammar": run_xgrammar}
    for name in args.engines.split(","):
        try:
            r = runners[name](tok, instances, schemas)
        except ImportError as e:
            print(f"| {name} | not installed ({e}) |")
            continue
        print(summary(name, r))
        print(f"<!-- {name}: mean mask {statistics.mean(r['mask']) * 1e6:.1f} us -->")


if __name__ == "__main__":
    main()
