"""`verispec audit sweep --endpoint VALUE=SPEC ...`: the acceptance sweep against live servers, one per value.

Three `verispec serve` apps over the tiny random Llama: a plain reference (no speculation, so its /metrics carry no
drafts: tau n/a), a second random tiny Llama as draft model at the exact rule (value 1.0, k=3) and at a relaxed
`threshold_single` (value 0.5, k=2), so tau differs between the values and the temperatures (greedy: the two random
argmaxes rarely agree; sampled: both distributions are near uniform and most drafts are accepted).
Oracles: greedy decoding is lossless and ignores the rule, so at temperature 0 every value must give the plain
server's bytes (delta 0); tau per (value, temperature) must equal 1 + accepted / drafts of the serving engine's
own counters (read from the Engine object, not through /metrics) over that run; relaxed % and TV are n/a.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers import live, make_app
from verispec.audit.graders import Grade
from verispec.audit.items import AuditItem
from verispec.audit.sweep import identical, run_sweep, sweep_rows
from verispec.audit.sweep_endpoint import (apply_endpoint_measurements, build_endpoint_sweep_sides,
                                           parse_endpoint_arg, parse_endpoints)

TOPICS = ["caches", "owls", "salt", "maps"]


def items() -> list[AuditItem]:
    return [AuditItem(id=f"t{i}", domain="creative" if i % 2 else "coding",
                      messages=({"role": "user", "content": f"Two lines about {w}."},), max_tokens=16, check={})
            for i, w in enumerate(TOPICS)]


def length_grader(item: AuditItem, output: str) -> Grade:
    score = min(1.0, len(output) / 40)
    return Grade(score, score >= 0.5, {"chars": len(output)})


@pytest.fixture(scope="module")
def drafter_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random tiny Llama (seed 1) with the same config and tokenizer files: a draft model unlike the target."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-drafter")
    with torch.random.fork_rng():
        torch.manual_seed(1)
        LlamaForCausalLM(AutoConfig.from_pretrained(tiny_dir)).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def servers(tiny_dir: Path, drafter_dir: Path):
    """{name: (url, BackgroundEngine)} for the plain reference and the draft model at values 1.0 and 0.5."""
    draft = {"method": "draft_model", "model": str(drafter_dir), "num_speculative_tokens": 3, "adaptive": False}
    apps = {"plain": make_app(tiny_dir), "1.0": make_app(tiny_dir, draft),
            "0.5": make_app(tiny_dir, {**draft, "num_speculative_tokens": 2, "acceptance_rule": "threshold",
                                       "threshold_single": 0.5})}
    with live(apps["plain"][0]) as u0, live(apps["1.0"][0]) as u1, live(apps["0.5"][0]) as u2:
        yield {"plain": (u0, apps["plain"][1]), "1.0": (u1, apps["1.0"][1]), "0.5": (u2, apps["0.5"][1])}


def _counting(side, engine, log: dict) -> None:
    """Wrap side.generate: the engine's own counters before and after each run, keyed by the run's temperature."""
    inner = side.generate

    def generate(jobs, progress, desc):
        c = engine.engine.counters
        before = (c.num_drafts, c.num_accepted_tokens)
        out = inner(jobs, progress, desc)
        log[jobs[0].temperature] = (c.num_drafts - before[0], c.num_accepted_tokens - before[1])
        return out

    side.generate = generate


def test_endpoint_sweep_against_live_servers(servers) -> None:
    (u0, _), (u1, e1), (u2, e2) = servers["plain"], servers["1.0"], servers["0.5"]
    ref_spec, specs = parse_endpoints([f"0.5=url={u2}/v1", f"1.0=url={u1}"], f"url={u0}/v1", "threshold_single")
    assert list(specs) == [1.0, 0.5] and specs[0.5].label.startswith("threshold_single=0.5")
    ref, cands = build_endpoint_sweep_sides(ref_spec, specs, concurrency=2)
    logs: dict[float, dict] = {1.0: {}, 0.5: {}}
    _counting(cands[1.0], e1, logs[1.0])
    _counting(cands[0.5], e2, logs[0.5])
    records, runs = run_sweep(items(), ref, cands, [0.0, 1.0], samples=2, grader=length_grader, progress=False)
    rows, _ = sweep_rows(records, runs, 200)
    apply_endpoint_measurements(rows, runs, ref, cands)
    assert all(r["error"] is None and r["token_ids"] for r in records)  # ids from return_token_ids
    by = {(r["value"], r["temperature"]): r for r in rows}
    assert len(by) == 6
    for v in (1.0, 0.5):
        greedy = by[(v, 0.0)]
        assert greedy["identical"] and greedy["delta"] == 0.0 and greedy["exact_match_pct"] == 100.0, greedy
        for t in (0.0, 1.0):
            drafts, acc = logs[v][t]
            assert drafts > 0, (v, t)  # the draft model proposed and was verified
            assert by[(v, t)]["tau"] == pytest.approx(1 + acc / drafts, abs=1e-9), (v, t, by[(v, t)])
            assert by[(v, t)]["tv_mean"] is None and by[(v, t)]["relaxed_share"] is None
            assert by[(v, t)]["tok_per_s"] > 0
    assert len({by[(v, t)]["tau"] for v in (1.0, 0.5) for t in (0.0, 1.0)}) == 3  # a misplaced tau would show
    assert by[(None, 0.0)]["tau"] is None and by[(None, 1.0)]["tau"] is None  # plain: no drafts, tau n/a
    run = next(r for r in runs if r["value"] == 0.5 and r["temperature"] == 1.0)
    assert run["metrics"]["spec_source"] == "verispec" and run["output_tokens"] > 0


def test_identity_compares_text_where_token_ids_are_missing() -> None:
    ref = [{"item_id": "a", "temperature": 0.0, "sample": 0, "token_ids": None, "text": "x y"}]
    same = [{**ref[0], "token_ids": [5, 6]}]
    assert identical(ref, same) and not identical(ref, [{**same[0], "text": "x z"}])
    assert not identical([{**ref[0], "token_ids": [5, 7]}], same)  # both have ids: they decide


def test_cli_endpoint_sweep(servers, tmp_path: Path, monkeypatch, capsys) -> None:
    import verispec.audit.graders as graders
    from verispec.cli import main

    monkeypatch.setattr(graders, "grade", length_grader)
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps({"id": it.id, "domain": it.domain, "messages": list(it.messages),
                                        "max_tokens": it.max_tokens, "check": {}}) + "\n" for it in items()))
    (u0, _), (u1, _), (u2, _) = servers["plain"], servers["1.0"], servers["0.5"]
    out = tmp_path / "sweep"
    base = ["audit", "sweep", "--rule", "threshold", "--param", "threshold_single", "--items", str(path),
            "--temperature", "0", "--bootstrap", "200", "--quiet", "--out", str(out)]
    assert main(base + ["--endpoint", f"1.0=url={u1}/v1", "--endpoint", f"0.5=url={u2}"]) == 0  # ref: value 1.0
    printed = capsys.readouterr().out
    assert "T=0: every value is byte-identical" in printed and "in-process only" in printed
    data = json.loads((out / "sweep.json").read_text())
    rows = data["tables"][0]["rows"]
    assert len(rows) == 3 and {r["byte-identical"] for r in rows} == {"yes"}
    assert all(r["delta"] == "+0.000" for r in rows if not r["threshold_single"].startswith("1 (exact"))
    assert all(r["TV mean"] == "n/a" and r["relaxed % of accepted"] == "n/a" for r in rows)
    assert all(float(r["tau"]) >= 1 for r in rows)  # the draft model's servers, reference included
    assert "n/a" in data["conditions"]["metric"] and (out / "sweep_tau_delta.png").stat().st_size > 1000
    assert main(base + ["--endpoint", f"0.5=url={u2}", "--reference-endpoint", f"url={u0}"]) == 0
    assert "byte-identical" in capsys.readouterr().out
    rows = json.loads((out / "sweep.json").read_text())["tables"][0]["rows"]
    assert [r["tau"] for r in rows] == ["n/a", "1.000"]  # plain reference: no drafts; greedy drafts all rejected
    errors = [(["--endpoint", f"0.5=url={u2}"], "needs a strict-verification reference"),
              (["--endpoint", f"0.5:url={u2}"], "VALUE=SPEC"),
              (["--endpoint", f"x=url={u2}"], "VALUE a number in"),
                  (["--endpoint", f"url={u2}"], "VALUE=SPEC"),
              (["--endpoint", f"1.5=url={u2}"], r"VALUE must be in \(0, 1\]"),
              (["--endpoint", f"0=url={u2}"], r"VALUE must be in \(0, 1\]"),
              (["--endpoint", "0.5=method=ngram", "--reference-endpoint", f"url={u0}"], "must name a server"),
              (["--reference-endpoint", f"url={u0}"], "needs at least one --endpoint"),
              (["--endpoint", f"1.0=url={u1}", "--values", "1.0,0.5"], "--values is for the in-process sweep"),
              (["--endpoint", f"1.0=url={u1}", "--endpoint", f"1=url={u2}"], "given twice")]
    for extra, match in errors:
        assert main(base + extra) == 2, extra
        assert re.search(match, capsys.readouterr().err), (extra, match)


def test_parse_endpoint_arg_keeps_the_spec() -> None:
    v, spec = parse_endpoint_arg("0.8=url=http://h:30001/v1,model=M,key=k")
    assert (v, spec.url, spec.model, spec.key) == (0.8, "http://h:30001/v1", "M", "k")
