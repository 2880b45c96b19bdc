"""Spec-Bench's question file as a workload: categories in the file's order, the first turn sent, the first N
questions per category, clear errors, and its tables' task grouping and geometric means (checked by hand)."""

from __future__ import annotations

import json
import math

import pytest

from verispec.bench.spec_bench import CATEGORIES, TASKS, Run, load_spec_bench, spec_bench_rows, task_of


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _q(qid, cat, *turns):
    return {"question_id": qid, "category": cat, "turns": list(turns), "reference": ["x"]}


def test_loads_first_turns_per_category_in_file_order(tmp_path):
    f = _write(tmp_path / "question.jsonl", [
        _q(81, "writing", "Compose a blog post.", "Rewrite it."), _q(82, "writing", "Draft an email."),
        _q(91, "roleplay", "Pretend to be Elon Musk."), _q(83, "writing", "Write a poem."),
        _q(1000, "translation", "Translate: Guten Morgen")])
    got = load_spec_bench(f, per_category=2, max_tokens=64)
    assert list(got) == ["writing", "roleplay", "translation"]
    assert [p.id for p in got["writing"]] == ["writing-81", "writing-82"]
    first = got["writing"][0]
    assert first.messages == ({"role": "user", "content": "Compose a blog post."},)
    assert first.workload == "writing" and first.max_tokens == 64
    assert len(load_spec_bench(f)["writing"]) == 3
    assert list(load_spec_bench(f, categories=["translation", "writing"])) == ["translation", "writing"]


def test_bad_files_name_the_line_or_the_category(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_spec_bench(tmp_path / "missing.jsonl")
    f = _write(tmp_path / "q.jsonl", [_q(1, "writing", "ok"), {"question_id": 2, "turns": ["no category"]}])
    with pytest.raises(ValueError, match=r"line 2.*category"):
        load_spec_bench(f)
    f = _write(tmp_path / "q.jsonl", [_q(1, "writing", "ok"), _q(1, "writing", "same id")])
    with pytest.raises(ValueError, match="duplicate id"):
        load_spec_bench(f)
    f = _write(tmp_path / "q.jsonl", [_q(1, "writing", "ok")])
    with pytest.raises(ValueError, match="rag"):
        load_spec_bench(f, categories=["rag"])
    with pytest.raises(ValueError, match="per_category"):
        load_spec_bench(f, per_category=0)


def test_thirteen_categories_in_six_tasks():
    assert len(CATEGORIES) == 13 and len(TASKS) == 6
    assert task_of("roleplay") == "Multi-turn Conversation" and task_of("rag") == "Retrieval-aug. Generation"
    assert task_of("something else") == "something else"


def test_tables_pool_mt_bench_and_take_geometric_means():
    runs = [Run("writing", 0.5, 1.0, True), Run("writing", 2.0, 2.0, True), Run("coding", 8.0, 3.0, False),
            Run("rag", 1.5, 2.5, True)]
    cats, tasks = spec_bench_rows(runs)
    assert [r["name"] for r in cats] == ["writing", "coding", "rag"]
    assert cats[0]["speedup"] == pytest.approx(1.0) and cats[0]["tau"] == pytest.approx(1.5)
    assert [r["name"] for r in tasks] == ["Multi-turn Conversation", "Retrieval-aug. Generation", "Overall"]
    assert tasks[0]["speedup"] == pytest.approx(2.0)  # (0.5 * 2 * 8) ** (1/3)
    assert tasks[0]["identical"] == "2/3" and (tasks[0]["min"], tasks[0]["max"]) == (0.5, 8.0)
    assert tasks[-1]["speedup"] == pytest.approx(math.prod([0.5, 2.0, 8.0, 1.5]) ** 0.25)


def test_bench_single_reports_spec_bench_tables(tiny_dir, tmp_path):
    from verispec import LLM
    from verispec.bench.single import run_single

    f = _write(tmp_path / "question.jsonl", [_q(1, "writing", "a b c a b c a b"), _q(2, "rag", "1, 2, 3, 1, 2, 3,"),
                                              _q(3, "rag", "x y x y x")])
    llm = LLM(str(tiny_dir), dtype="float32", progress=False, max_num_seqs=1)
    rep = run_single(methods=("ngram",), limit=1, max_tokens=6, k=2, progress=False, llm=llm, spec_bench=str(f))
    assert {r["workload"] for r in rep.records} == {"writing", "rag"}  # one question per category
    titles = [t.title for t in rep.tables]
    assert "Spec-Bench per category: ngram" in titles and "Spec-Bench per task: ngram" in titles
    tasks = next(t for t in rep.tables if t.title == "Spec-Bench per task: ngram").rows
    assert [r["name"] for r in tasks] == ["Multi-turn Conversation", "Retrieval-aug. Generation", "Overall"]
    assert all(r["identical"] == "1/1" for r in tasks[:2])
