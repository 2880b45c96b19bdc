"""`bench single` and the report writer: complete records, identity against HF's greedy output, and report files
that hold what they claim."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from tests.helpers import hf_greedy
from verispec import LLM, SamplingParams
from verispec.bench.report import Report, Table, percentile, write_report
from verispec.bench.single import drafter_bytes, run_single
from verispec.bench.workloads import load_workload


@pytest.fixture(scope="module")
def report(tiny_dir, tmp_path_factory):
    user = tmp_path_factory.mktemp("wl") / "mine.jsonl"
    user.write_text("\n".join(json.dumps({"id": f"u{i}", "prompt": p, "max_tokens": 10})
                              for i, p in enumerate(["a b c a b c a b", "1, 2, 3, 1, 2, 3,"])))
    llm = LLM(str(tiny_dir), dtype="float32", progress=False, max_num_seqs=1)
    rep = run_single(methods=("ngram", "suffix"), workloads=("json_records", str(user)), limit=2, repeats=2,
                     max_tokens=10, k=4, progress=False, llm=llm)
    return rep, llm


def test_records_are_complete_and_outputs_match_hf(report, hf, tok):
    rep, llm = report
    assert len(rep.records) == 2 * 2 * 2 * 3  # workloads x prompts x repeats x (plain + 2 methods)
    keys = {"workload", "prompt_id", "method", "ttft_s", "e2e_s", "tok_per_s", "ratio", "tau", "per_position_acceptance",
            "draft_s", "forward_s", "verify_s", "sched_s", "state_s", "identical", "first_divergence", "common_prefix_pct"}
    for x in rep.records:
        assert keys <= set(x)
        assert 0 < x["ttft_s"] <= x["e2e_s"]
        assert x["identical"] and x["common_prefix_pct"] == 100.0, x["divergence"]
    # the plain outputs equal HF transformers' greedy output (an independent implementation)
    wp = load_workload("json_records", limit=1)[0]
    ids = tok(llm.apply_chat_template(list(wp.messages)), add_special_tokens=False)["input_ids"]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    ref = hf_greedy(hf, ids, len(out.token_ids))
    assert out.token_ids == ref
    plain = [x for x in rep.records if x["method"] == "none"]
    assert all(x["ratio"] == 1.0 and x["tau"] == 1.0 for x in plain)


def test_report_files_state_the_conditions_and_hold_the_plots(report, tmp_path):
    rep, _ = report
    paths = write_report(rep, tmp_path)
    for kind in ("json", "csv", "md", "html", "tau_per_workload", "step_time_split"):
        assert paths[kind].exists() and paths[kind].stat().st_size > 0
    md = paths["md"].read_text()
    for cond in ("concurrency", "metric", "baseline"):
        assert f"**{cond}**" in md
    assert "machine load over the" in md and "of the" in md  # how much of the CPUs others took while it ran
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == len(rep.figures) and "<table>" in page
    raw = json.loads(paths["json"].read_text())
    assert len(raw["records"]) == len(rep.records)
    assert len(paths["csv"].read_text().strip().splitlines()) == len(rep.records) + 1


def test_a_report_without_its_conditions_is_refused():
    with pytest.raises(ValueError, match="baseline"):
        Report("x", {"concurrency": "1", "metric": "tok/s"}, [Table("t", [])])


@pytest.mark.parametrize("seed", range(5))
def test_percentiles_match_numpy(seed):
    rng = random.Random(seed)
    xs = [rng.expovariate(1.0) for _ in range(rng.randint(1, 50))]
    for q in (50, 95, 99):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert np.isnan(percentile([], 50))


def test_drafter_share_of_a_draft_model(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", progress=False, max_num_seqs=1,
              speculative_config={"method": "draft_model", "model": str(tiny_dir)})
    hf_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(tiny_dir)).parameters())
    cfg = llm.model.cfg
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * llm.max_model_len * 4
    assert drafter_bytes(llm) == hf_params * 4 + kv  # parameters() counts tied embeddings once, as we hold them
    assert drafter_bytes(LLM(str(tiny_dir), dtype="float32", progress=False, max_num_seqs=1)) == 0
