"""`verispec audit` end to end on a tiny random Llama (the default model's tokenizer and chat template).

Oracles: plain decoding through `LLM.chat` on its own (the in-process side's outputs), the lossless guarantee (an
n-gram candidate at temperature 0 equals plain decoding), a candidate degraded on purpose (outputs cut to a few
tokens) that a length grader must catch, and a live `verispec serve` app (an endpoint side equals the in-process
one). The items and graders are built here, not the shipped domains.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import pytest

from tests.helpers import live, make_app
from verispec.audit.graders import Grade
from verispec.audit.items import AuditItem
from verispec.audit.runner import EndpointSide, Generation, Job, build_sides, job_seed, make_jobs, run_audit
from verispec.audit.spec import EndpointSpec, EngineSpec, parse_spec
from verispec.audit.stats import pair_up, per_domain

TOPICS = ["caches", "rivers", "owls", "trains", "salt", "clocks", "maps", "bees", "glass", "tides", "moss", "kites"]


def items(n: int = 6, max_tokens: int = 12) -> list[AuditItem]:
    return [AuditItem(id=f"t{i}", domain="creative" if i % 2 else "coding",
                      messages=({"role": "user", "content": f"Write two lines about {TOPICS[i % len(TOPICS)]}."},),
                      max_tokens=max_tokens, check={}) for i in range(n)]


def length_grader(item: AuditItem, output: str) -> Grade:
    """Longer is better, up to 40 characters: cutting an output short lowers its score."""
    score = min(1.0, len(output) / 40)
    return Grade(score, score >= 0.5, {"chars": len(output)})


def rows(records) -> dict[tuple[str, float], dict]:
    return {(r["domain"], r["temperature"]): r for r in per_domain(pair_up(records), n_resamples=500)}


# ---- SPEC parsing ----------------------------------------------------------------------------------------------------

def test_parse_engine_specs() -> None:
    assert parse_spec("plain") == EngineSpec()
    assert parse_spec("plain,dtype=float32") == EngineSpec(dtype="float32")
    s = parse_spec("method=ngram,k=4,dtype=float32,scheduler=static,adaptive=false")
    assert s == EngineSpec(method="ngram", k=4, dtype="float32", scheduler="static", adaptive=False)
    assert s.speculative_config() == {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    j = parse_spec('{"method": "suffix", "num_speculative_tokens": 6, "acceptance_rule": "threshold", '
                   '"threshold_acc": 0.2}')
    assert j.k == 6 and j.rule == "threshold" and j.lossy
    assert j.speculative_config()["acceptance_rule"] == "threshold"
    assert parse_spec("method=draft_model,drafter=./small").speculative_config()["model"] == "./small"
    assert parse_spec("method=plain") == EngineSpec()


def test_parse_endpoint_specs() -> None:
    e = parse_spec("url=http://127.0.0.1:8000/v1,model=m,key=sk-1")
    assert e == EndpointSpec(url="http://127.0.0.1:8000/v1", model="m", key="sk-1")
    assert parse_spec('{"url": "https://x.example/v1"}') == EndpointSpec(url="https://x.example/v1")


@pytest.mark.parametrize("text,match", [
    ("", "empty SPEC"),
    ("method=ngrm", "method='ngrm' is not one of"),
    ("method=ngram,k=0", "k must be an integer in 1..64"),
    ("method=ngram,k=four", "k must be an integer"),
    ("method=ngram,colour=red", "unknown SPEC key"),
    ("method=ngram,method=suffix", "given twice"),
    ("ngram", "is not key=value"),
    ("dtype=float64", "dtype='float64'"),
    ("plain,k=4", "need a speculative method"),
    ("method=draft_model", "needs drafter=PATH"),
    ("method=ngram,rule=threshold,threshold_acc=2", r"threshold_acc must be a number in \(0, 1\]"),
    ("url=localhost:8000", "must start with http"),
    ("url=http://h/v1,method=ngram", "unknown endpoint SPEC key"),
    ("{not json", "not valid JSON"),
    ("[1]", "is not key=value"),
])
def test_parse_spec_errors_are_clear(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_spec(text)


# ---- jobs and the runner with fake sides -----------------------------------------------------------------------------

def test_jobs_seeds_and_samples() -> None:
    its = items(3)
    jobs = make_jobs(its, [0.0, 1.0], samples=4, base_seed=7, max_tokens=5)
    assert sum(j.temperature == 0 for j in jobs) == 3  # greedy: one sample per item
    assert sum(j.temperature == 1 for j in jobs) == 12
    assert all(j.max_tokens == 5 for j in jobs)
    assert jobs == make_jobs(its, [0.0, 1.0], samples=4, base_seed=7, max_tokens=5)  # reproducible
    hot = [j for j in jobs if j.temperature == 1]
    assert len({j.seed for j in hot}) == 12 and job_seed("t0", 1, 7) == next(
        j.seed for j in hot if j.item.id == "t0" and j.sample == 1)
    with pytest.raises(ValueError):
        make_jobs(its, [0.0], samples=0)


class FakeSide:
    """Answers each job with a fixed function of (item, seed); optionally fails some requests."""

    def __init__(self, answer, fail: set[str] = frozenset()) -> None:
        self.answer, self.fail, self.seen = answer, fail, []

    def describe(self) -> str:
        return "fake"

    def generate(self, jobs: Sequence[Job], progress: bool, desc: str) -> list[Generation]:
        self.seen += [(j.item.id, j.temperature, j.sample, j.seed) for j in jobs]
        return [Generation("", None, error="http_500: down") if j.item.id in self.fail
                else Generation(self.answer(j), None, "stop") for j in jobs]


def test_runner_records_both_sides_with_the_same_seeds() -> None:
    ref = FakeSide(lambda j: "x" * 40)
    cand = FakeSide(lambda j: "x" * (40 if j.seed % 2 else 10), fail={"t5"})
    recs = run_audit(items(6), cand, ref, [0.0, 1.0], samples=3, grader=length_grader, progress=False)
    assert ref.seen == cand.seen and len(recs) == 2 * len(ref.seen) == 2 * (6 + 18)
    keys = {"item_id", "domain", "side", "sample", "temperature", "seed", "text", "token_ids", "score", "passed",
            "grade", "error"}
    assert all(keys <= set(r) for r in recs)
    failed = [r for r in recs if r["error"]]
    assert len(failed) == 4 and all(r["item_id"] == "t5" and r["side"] == "candidate" for r in failed)
    losses = sum(r["side"] == "candidate" and not r["error"] and r["seed"] % 2 == 0 for r in recs)
    table = per_domain(pair_up(recs), n_resamples=200)
    assert sum(t["losses"] for t in table if t["domain"] != "all") == losses
    assert sum(t["errors"] for t in table if t["domain"] != "all") == 4


def test_grader_errors_are_recorded_not_raised() -> None:
    def broken(item: AuditItem, output: str) -> Grade:
        if not output:
            return Grade(0.0, False)
        raise RuntimeError("grader bug")

    recs = run_audit(items(2), FakeSide(lambda j: "a"), FakeSide(lambda j: "a"), [0.0], grader=broken,
                     progress=False)
    assert all(r["error"] == "grader: RuntimeError: grader bug" for r in recs)


def test_malformed_checks_fail_before_generation() -> None:
    def strict(item: AuditItem, output: str) -> Grade:
        if item.id == "t1":
            raise ValueError("check needs 'words'")
        return Grade(1.0, True)

    side = FakeSide(lambda j: "a")
    with pytest.raises(ValueError, match="audit item 't1' .*check needs 'words'"):
        run_audit(items(3), side, side, [0.0], grader=strict, progress=False)
    assert side.seen == []


# ---- the real engine on a tiny model ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_llm(tiny_dir: Path):
    from verispec import LLM

    return LLM(str(tiny_dir), dtype="float32", progress=False, max_num_seqs=4)


def test_engine_against_itself_finds_nothing(tiny_dir: Path, plain_llm) -> None:
    from verispec import SamplingParams

    spec = parse_spec("method=ngram,k=4,dtype=float32")
    cand, ref = build_sides(spec, spec, str(tiny_dir), max_num_seqs=4, progress=False)
    its = items(6)
    recs = run_audit(its, cand, ref, [0.0, 1.0], samples=2, grader=length_grader, progress=False)
    for (dom, t), s in rows(recs).items():
        assert s["pairs"] > 0 and s["delta"] == 0.0 and (s["ci_low"], s["ci_high"]) == (0.0, 0.0), (dom, t, s)
        assert s["exact_match_pct"] == 100.0 and s["wins"] == s["losses"] == 0 and s["sign_p"] == 1.0
    # the in-process side's greedy outputs are plain decoding's (LLM.chat on its own, one prompt at a time)
    for it in its:
        want = plain_llm.chat(list(it.messages), SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        got = [r for r in recs if r["item_id"] == it.id and r["temperature"] == 0]
        assert {tuple(r["token_ids"]) for r in got} == {tuple(want.token_ids)} and got[0]["text"] == want.text
        assert len(want.token_ids) > 0


def test_ngram_candidate_equals_plain_at_temperature_zero(tiny_dir: Path) -> None:
    cand, ref = build_sides(parse_spec("method=ngram,k=4,dtype=float32,scheduler=static"),
                            parse_spec("plain,dtype=float32"), str(tiny_dir), max_num_seqs=4, progress=False)
    assert cand.llm.model is ref.llm.model  # one target loaded, shared
    assert cand.llm.scheduler == "static" and ref.llm.scheduler is None  # each side its own scheduler
    recs = run_audit(items(6, max_tokens=64), cand, ref, [0.0], grader=length_grader, progress=False)
    assert max(r["tau"] for r in recs if r["side"] == "candidate") > 1.0  # drafts were accepted somewhere
    s = rows(recs)[("all", 0.0)]
    # lossless: identical, or divergent only at a near-tie of the target (reported with its margin)
    assert s["exact_match_pct"] + 100 * s["near_ties"] / s["pairs"] == pytest.approx(100.0), s


def test_margin_at_the_first_divergence_is_the_targets(tiny_dir: Path, hf) -> None:
    """A greedy candidate that differs from the reference gets the target's top-1/top-2 margin there (HF's)."""
    import torch

    from verispec.audit.runner import add_margins, record

    cand, ref = build_sides(parse_spec("method=ngram,k=4,dtype=float32"), parse_spec("plain,dtype=float32"),
                            str(tiny_dir), max_num_seqs=4, progress=False)
    jobs = make_jobs(items(2), [0.0], 1)
    ref_gens = ref.generate(jobs, False, "ref")
    cand_gens = [Generation(g.text, g.token_ids[:3] + [7] + g.token_ids[4:], "length", g.prompt_ids)
                 for g in ref_gens]
    recs = [record("candidate", j, g, length_grader, "c") for j, g in zip(jobs, cand_gens)]
    add_margins(recs, ref_gens, cand_gens, ref, cand)
    for r, g in zip(recs, ref_gens):
        with torch.no_grad():
            logits = hf(torch.tensor([g.prompt_ids + g.token_ids[:3]])).logits[0, -1]
        top = logits.topk(2).values
        assert r["margin"] == pytest.approx(float(top[0] - top[1]), abs=1e-4) and r["near_tie"] is False
    assert pair_up(recs + [record("reference", j, g, length_grader, "r") for j, g in zip(jobs, ref_gens)])[0][
        "first_divergence"] == 3


class TruncatingSide:
    """A deliberately degraded candidate: the wrapped side's outputs cut to their first `n` tokens."""

    def __init__(self, inner, n: int) -> None:
        self.inner, self.n = inner, n

    def describe(self) -> str:
        return f"{self.inner.describe()} cut to {self.n} tokens"

    def generate(self, jobs, progress, desc):
        gens = self.inner.generate(jobs, progress, desc)
        return [Generation(self.inner.llm.decode(g.token_ids[: self.n]), g.token_ids[: self.n], "length",
                           g.prompt_ids) for g in gens]


def test_a_degraded_candidate_is_caught(tiny_dir: Path, tmp_path: Path) -> None:
    from verispec.audit.report import build_report, write_audit_report

    cand, ref = build_sides(parse_spec("method=ngram,k=4,dtype=float32"), parse_spec("plain,dtype=float32"),
                            str(tiny_dir), max_num_seqs=4, progress=False)
    recs = run_audit(items(12, max_tokens=16), TruncatingSide(cand, 2), ref, [1.0], samples=2,
                     grader=length_grader, progress=False)
    s = rows(recs)[("all", 1.0)]
    assert s["pairs"] == 24 and s["losses"] >= 20 and s["sign_p"] < 0.05 and s["ci_high"] < 0, s
    assert s["exact_match_pct"] < 10
    rep, _ = build_report(recs, candidate="cut", reference="plain", concurrency="in process, 4 at a time",
                          n_resamples=500)
    assert any("WORSE" in n for n in rep.notes), rep.notes
    paths = write_audit_report(rep, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert len(data["records"]) == 48 and {"text", "token_ids", "score", "grade"} <= set(data["records"][0])
    md = paths["md"].read_text()
    assert all(f"**{c}**" in md for c in ("concurrency", "metric", "baseline"))
    assert paths["delta_per_domain"].stat().st_size > 1000 and "data:image/png;base64" in paths["html"].read_text()


def test_truncate_key_is_the_negative_control(tiny_dir: Path) -> None:
    """`truncate=N` keeps the first N tokens of what the same configuration would say (at T=1 too: same seeds), and
    the audit catches the drop."""
    spec = parse_spec("plain,dtype=float32,truncate=2")
    assert spec.truncate == 2 and "truncate=2" in spec.describe()
    for bad in ("plain,truncate=0", "plain,truncate=x"):
        with pytest.raises(ValueError, match="truncate"):
            parse_spec(bad)
    cand, ref = build_sides(spec, parse_spec("plain,dtype=float32"), str(tiny_dir), max_num_seqs=4, progress=False)
    recs = run_audit(items(12, max_tokens=16), cand, ref, [1.0], samples=2, grader=length_grader, progress=False)
    by = {(r["item_id"], r["sample"]): r for r in recs if r["side"] == "reference"}
    for c in (r for r in recs if r["side"] == "candidate"):
        assert c["token_ids"] == by[(c["item_id"], c["sample"])]["token_ids"][:2]
    s = rows(recs)[("all", 1.0)]
    assert s["sign_p"] < 0.05 and s["ci_high"] < 0, s


def test_endpoint_side_against_a_live_server(tiny_dir: Path) -> None:
    app, _ = make_app(tiny_dir)
    (plain,) = build_sides(parse_spec("plain,dtype=float32"), parse_spec("plain,dtype=float32"), str(tiny_dir),
                           max_num_seqs=4, progress=False)[:1]
    with live(app) as url:
        ep = EndpointSide(parse_spec(f"url={url}/v1"), concurrency=3)
        recs = run_audit(items(6), ep, plain, [0.0], grader=length_grader, progress=False)
        bad = EndpointSide(EndpointSpec(url=f"{url}/v1", model="no-such-model"))
        with pytest.raises(ValueError, match="HTTP 404"):
            run_audit(items(1), bad, plain, [0.0], grader=length_grader, progress=False)
    assert ep.model and ep.token_ids  # the model id from /v1/models; token ids from return_token_ids
    cands = [r for r in recs if r["side"] == "candidate"]
    assert all(r["error"] is None and r["token_ids"] for r in cands)
    s = rows(recs)[("all", 0.0)]
    assert s["exact_match_pct"] == 100.0 and s["delta"] == 0.0, s



AGENT = AuditItem(id="agent-t", domain="agent", messages=({"role": "user", "content": "Weather in Oslo?"},),
                  max_tokens=24, check={"tools": [{"name": "get_weather", "parameters": {
                      "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                      "required": ["city"]}}], "expected_tool": "get_weather", "expected_args": {"city": "Oslo"}})


def test_agent_items_send_real_tools() -> None:
    from verispec.audit.runner import _parse_choice

    ep = EndpointSide(EndpointSpec(url="http://x/v1", model="m"))
    agent_job, plain_job = (Job(it, 0.0, 0, 1, 8) for it in (AGENT, items(1)[0]))
    body = ep.body(agent_job)
    assert body["tool_choice"] == "auto" and body["tools"] == [
        {"type": "function", "function": AGENT.check["tools"][0]}]
    assert "tools" not in ep.body(plain_job)
    ep.tools = False  # after a 400 naming them: the free-text path
    assert "tools" not in ep.body(agent_job)

    class Response:
        text = ""

        def __init__(self, body):
            self.body = body

        def json(self):
            return self.body

    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    g = _parse_choice(Response({"choices": [{"message": {"content": None, "tool_calls": [call]},
                                             "finish_reason": "tool_calls"}]}))
    assert g.text == "" and g.tool_calls == [call]
    # the shipped grader scores the returned calls
    side = FakeSide(lambda j: "")
    side.generate = lambda jobs, progress, desc: [Generation("", None, "tool_calls", tool_calls=[call]) for _ in jobs]
    recs = run_audit([AGENT], side, side, [0.0], progress=False)
    assert all(r["passed"] and r["tool_calls"] == [call] and r["grade"]["source"] == "tool_calls" for r in recs)


def test_engine_and_endpoint_run_agent_items_with_tools(tiny_dir: Path, plain_llm) -> None:
    from verispec import SamplingParams
    from verispec.audit.runner import item_tools

    app, _ = make_app(tiny_dir)
    (plain,) = build_sides(parse_spec("plain,dtype=float32"), parse_spec("plain,dtype=float32"), str(tiny_dir),
                           max_num_seqs=4, progress=False)[:1]
    want = plain_llm.chat(list(AGENT.messages), SamplingParams(temperature=0, max_tokens=24), use_tqdm=False,
                          tools=item_tools(AGENT))[0]
    assert "get_weather" in want.prompt and isinstance(want.tool_calls, list)
    with live(app) as url:
        ep = EndpointSide(parse_spec(f"url={url}/v1"), concurrency=2)
        recs = run_audit([AGENT], ep, plain, [0.0], progress=False)
    assert ep.tools  # the server took them
    ref, cand = (next(r for r in recs if r["side"] == s) for s in ("reference", "candidate"))
    assert ref["error"] is None and cand["error"] is None
    # in process: the prompt and output of LLM.chat(tools=...); the endpoint: the same tokens
    assert ref["token_ids"] == want.token_ids == cand["token_ids"] and ref["text"] == want.text
    assert [c["function"] for c in ref["tool_calls"] or []] == [c["function"] for c in want.tool_calls]

def test_cli_end_to_end(tiny_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    import verispec.audit.graders as graders
    from verispec.cli import main

    monkeypatch.setattr(graders, "grade", length_grader)  # the test's grader, not the shipped domains'
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps({"id": it.id, "domain": it.domain, "messages": list(it.messages),
                                        "max_tokens": it.max_tokens, "check": {}}) + "\n" for it in items(4)))
    out = tmp_path / "report"
    rc = main(["audit", "--candidate", "method=ngram,k=4,dtype=float32", "--reference", "plain,dtype=float32",
               "--items", str(path), "--temperature", "0,1", "--samples", "2", "--model", str(tiny_dir),
               "--max-num-seqs", "4", "--bootstrap", "200", "--quiet", "--out", str(out)])
    assert rc == 0
    assert "| all |" in capsys.readouterr().out
    data = json.loads((out / "audit.json").read_text())
    assert len(data["records"]) == 2 * (4 + 8)
    assert {p.name for p in out.iterdir()} >= {"audit.json", "audit.csv", "audit.md", "audit.html",
                                                "delta_per_domain.png"}
    assert main(["audit", "--candidate", "method=ngram,k=x", "--reference", "plain", "--out", str(out)]) == 2
    assert "k must be an integer" in capsys.readouterr().err
