"""`verispec bench sweep` against a live server on a tiny random Llama, and against a server that never answers.

Oracles: the engine's own per-request speculative accounting and its counters read directly (for the /metrics
deltas), exact token counts from `ignore_eos` (for the per-request records), hand-computed percentiles, literal
Prometheus texts in the three name families, and the wall clock (a bounded level stops by itself).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import live, make_app
from verispec.bench.client import RequestRecord, StreamError, _ChunkReader, finalize
from verispec.bench.promscrape import parse_spec_metrics, spec_delta
from verispec.bench.sweep import Level, LevelResult, add_sweep_args, poisson_arrivals, run_sweep
from verispec.bench.sweep_report import first_divergence, ratio_rows, summarize

MAX_TOKENS = 10


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_sweep_args(ap)
    return ap.parse_args(argv)


# ---- Prometheus parsing: the three name families ------------------------------------------------------------
VERISPEC = """# HELP verispec:spec_decode_num_drafts Speculative steps that verified at least one draft token.
# TYPE verispec:spec_decode_num_drafts counter
verispec:spec_decode_num_drafts_total {d}
# TYPE verispec:spec_decode_num_draft_tokens counter
verispec:spec_decode_num_draft_tokens_total {t}
# TYPE verispec:spec_decode_num_accepted_tokens counter
verispec:spec_decode_num_accepted_tokens_total {a}
# TYPE verispec:spec_decode_num_accepted_tokens_per_pos counter
verispec:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {p0}
verispec:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {p1}
# TYPE verispec:num_requests_running gauge
verispec:num_requests_running 0.0
"""
VLLM = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 7.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 3.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""
SGLANG = """# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="m",tp_rank="0"} 3.5
sglang:spec_accept_length{model_name="m",tp_rank="1"} 2.5
# HELP sglang:spec_accept_rate The average acceptance rate of speculative decoding.
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{model_name="m",tp_rank="0"} 0.6
"""

# llama-server --metrics, as tools/server/server-task.cpp (llama-cpp-python 0.3.36's llama.cpp) writes it: the family
# is named with its _total suffix
LLAMACPP = """# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total {t}
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total {a}
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total {d}
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {p0}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {p1}
"""


def test_llama_server_counters_are_read() -> None:
    before = parse_spec_metrics(LLAMACPP.format(t=0, a=0, d=0, p0=0, p1=0))
    after = parse_spec_metrics(LLAMACPP.format(t=70, a=23, d=10, p0=9, p1=8))
    assert (after.family, after.drafts, after.draft_tokens, after.accepted) == ("llamacpp", 10, 70, 23)
    d = spec_delta(before, after)
    assert d["tau"] == 1 + 23 / 10 and d["acceptance_rate"] == 23 / 70 and d["per_pos_accepted"] == [9, 8]


def test_prometheus_parsing_of_three_families() -> None:
    before = parse_spec_metrics(VERISPEC.format(d=4, t=16, a=6, p0=4, p1=2))
    after = parse_spec_metrics(VERISPEC.format(d=10, t=40, a=21, p0=9, p1=7) + "# TYPE other counter\nother_total 1\n")
    assert (after.family, after.drafts, after.draft_tokens, after.accepted, after.busy) == ("verispec", 10, 40, 21, 0)
    d = spec_delta(before, after)
    assert (d["drafts"], d["draft_tokens"], d["accepted"]) == (6, 24, 15)
    assert d["acceptance_rate"] == 15 / 24 and d["tau"] == 1 + 15 / 6
    assert d["per_pos_accepted"] == [5, 5] and d["per_pos_acceptance"] == [5 / 6, 5 / 6]

    v = parse_spec_metrics(VLLM)  # series of both engines summed; _created samples ignored
    assert (v.family, v.drafts, v.draft_tokens, v.accepted, v.busy) == ("vllm", 10, 40, 25, 2)
    assert v.per_pos == {0: 9, 1: 8, 2: 5, 3: 3}
    d = spec_delta(parse_spec_metrics(VLLM.replace(" 7.0", " 2.0").replace(" 40.0", " 20.0")), v)
    assert (d["drafts"], d["draft_tokens"], d["tau"]) == (5, 20, 1 + 0 / 5)  # nothing accepted in between

    s = parse_spec_metrics(SGLANG)
    assert s.family == "sglang" and s.gauges == {"accept_length": 3.0, "accept_rate": 0.6}
    d = spec_delta(s, s, [s, parse_spec_metrics(SGLANG.replace("3.5", "5.5"))])
    assert d["tau"] == 3.0 and d["acceptance_rate"] == 0.6 and d["tau_sampled_mean"] == 3.5
    assert d["spec_source"].startswith("sglang")

    info = 'verispec:engine_config_info{path="gguf-int4",dtype="bfloat16",cpu_flags="avx2 fma"} 1.0\n'
    assert parse_spec_metrics("# TYPE verispec:engine_config_info gauge\n" + info).config == {
        "path": "gguf-int4", "dtype": "bfloat16", "cpu_flags": "avx2 fma"}
    for fam in ("verispec", "vllm"):  # the queue-time histogram: mean seconds from arrival to admission
        hist = (f"# TYPE {fam}:request_queue_time_seconds histogram\n"
                f'{fam}:request_queue_time_seconds_bucket{{{{le="+Inf"}}}} {{n}}\n'
                f"{fam}:request_queue_time_seconds_count {{n}}\n{fam}:request_queue_time_seconds_sum {{s}}\n")
        q0, q1 = parse_spec_metrics(hist.format(n=2, s=0.5)), parse_spec_metrics(hist.format(n=6, s=2.5))
        assert q1.queue == (2.5, 6) and spec_delta(q0, q1)["queue_mean_s"] == pytest.approx(2.0 / 4)
        assert spec_delta(q0, q1)["queued_requests"] == 4 and math.isnan(spec_delta(q1, q1)["queue_mean_s"])
    clock = ("# TYPE verispec:engine_steps counter\nverispec:engine_steps_total {n}\n"
             "# TYPE verispec:engine_forward_tokens counter\nverispec:engine_forward_tokens_total {t}\n"
             "# TYPE verispec:engine_step_seconds counter\n"
             'verispec:engine_step_seconds_total{{phase="schedule"}} {s}\n'
             'verispec:engine_step_seconds_total{{phase="forward"}} {f}\n')
    c0 = parse_spec_metrics(VERISPEC.format(d=0, t=0, a=0, p0=0, p1=0) + clock.format(n=10, t=40, s=0.5, f=2.0))
    c1 = parse_spec_metrics(VERISPEC.format(d=0, t=0, a=0, p0=0, p1=0) + clock.format(n=30, t=200, s=0.9, f=8.0))
    d = spec_delta(c0, c1)  # 20 steps, 160 rows, 0.4 s of scheduling and 6 s of forwards between the two scrapes
    assert (d["engine_steps"], d["rows_per_step"]) == (20, 8)
    assert d["step_schedule_ms"] == pytest.approx(20.0) and d["step_forward_ms"] == pytest.approx(300.0)
    assert d["step_ms"] == pytest.approx(320.0) and "step_ms" not in spec_delta(c1, c1)
    for fam in ("verispec", "vllm"):  # prefix caching: tokens looked up / found, vLLM V1's names (series summed)
        cache = (f"# TYPE {fam}:prefix_cache_queries counter\n{fam}:prefix_cache_queries_total{{{{engine=\"0\"}}}} {{q}}\n"
                 f"{fam}:prefix_cache_queries_total{{{{engine=\"1\"}}}} 10.0\n"
                 f"# TYPE {fam}:prefix_cache_hits counter\n{fam}:prefix_cache_hits_total{{{{engine=\"0\"}}}} {{h}}\n")
        p0, p1 = parse_spec_metrics(cache.format(q=100, h=32)), parse_spec_metrics(cache.format(q=300, h=182))
        assert p1.prefix == {"queries": 310, "hits": 182}
        d = spec_delta(p0, p1)
        assert (d["prefix_queries"], d["prefix_hits"], d["prefix_hit_rate"]) == (200, 150, 0.75)
        assert "prefix_hit_rate" not in spec_delta(p1, p0), "a counter that went backwards gives no rate"
    assert "prefix_hit_rate" not in spec_delta(after, after)  # not exported
    nothing = parse_spec_metrics("# TYPE up gauge\nup 1\n")
    assert nothing.family is None and math.isnan(spec_delta(nothing, nothing)["tau"])
    restarted = spec_delta(after, before)  # counters went backwards
    assert math.isnan(restarted["tau"]) and "restarted" in restarted["spec_source"]


# ---- per-request timing and level summaries, against hand-computed values -------------------------------------
def rec(i: int, times: list[float], tokens: list[int], *, status: str = "ok", err: str | None = None,
        headers: float = 0.01) -> RequestRecord:
    r = RequestRecord(i, f"p{i}", "w", token_source="token_ids", chunk_tokens=list(tokens), headers_s=headers)
    finalize(r, 0.0, times, None)
    r.status, r.error_class = status, err
    return r


def test_finalize_and_summary_percentiles_by_hand() -> None:
    # chunks at 0.1 s (1 token), 0.3 s (3 tokens: speculation), 0.4 s (1 token)
    r = rec(0, [0.1, 0.3, 0.4], [1, 3, 1])
    assert r.n_out == 5 and r.ttft_s == 0.1 and r.e2e_s == 0.4
    assert r.tpot_s == pytest.approx((0.4 - 0.1) / 4)
    assert r.chunk_gaps_s == pytest.approx([0.2, 0.1])
    assert r.itl_s == pytest.approx([0.2 / 3] * 3 + [0.1])  # one ITL per token of the chunk, gap / 3 each

    recs = [rec(0, [0.1, 0.3, 0.4], [1, 3, 1]),  # ttft 0.1, e2e 0.4, tpot 0.075
            rec(1, [0.2, 0.4], [1, 1]),  # ttft 0.2, e2e 0.4, tpot 0.2
            rec(2, [0.5], [1]),  # one token: no TPOT
            rec(3, [0.3, 0.9], [1, 2]),  # ttft 0.3, e2e 0.9, tpot 0.3
            rec(4, [], [], status="error", err="timeout"),
            rec(5, [], [], status="error", err="http_503")]
    res = LevelResult("ep", Level("concurrency", 4, 6), 0, recs, duration_s=2.0)
    row = summarize(res, (0.25, None, 0.8))  # TTFT <= 0.25 and E2E <= 0.8: requests 0 and 1
    assert (row["sent"], row["completed"], row["errors"]) == (6, 4, 2)
    assert row["errors_by_class"] == "http_503=1 timeout=1"
    assert row["req_per_s"] == 2.0 and row["out_tok_per_s"] == (5 + 2 + 1 + 3) / 2.0
    assert row["goodput_req_per_s"] == 1.0
    # TTFT over completed: 100, 200, 300, 500 ms; linear interpolation at (n-1) q / 100
    assert row["ttft_p50_ms"] == pytest.approx(250.0)
    assert row["ttft_p95_ms"] == pytest.approx(300 + 0.85 * 200)
    assert row["ttft_p99_ms"] == pytest.approx(300 + 0.97 * 200)
    # TPOT: 75, 200, 300 ms (request 2 has none)
    assert row["tpot_p50_ms"] == pytest.approx(200.0) and row["tpot_p99_ms"] == pytest.approx(200 + 0.98 * 100)
    # per-token ITL pooled: 66.7 x3, 100, 200, 300 (request 3: a 0.6 s gap over 2 tokens) x2
    itl = sorted([200 / 3] * 3 + [100, 200] + [300] * 2)
    assert row["itl_p50_ms"] == pytest.approx(itl[3])
    assert row["itl_p95_ms"] == pytest.approx(itl[5] + 0.7 * (itl[6] - itl[5]))
    assert row["gap_p50_ms"] == pytest.approx(200.0)  # raw gaps 200, 100, 200, 600
    assert row["e2e_p50_s"] == pytest.approx(0.45) and row["headers_p50_ms"] == pytest.approx(10.0)

    # paired ratios: method / baseline for throughput, baseline / method for latency, median over repeats
    spec = [dict(row, repeat=1), dict(row, repeat=2, out_tok_per_s=row["out_tok_per_s"] * 2, tpot_p50_ms=100.0)]
    base = [dict(row, repeat=1, out_tok_per_s=row["out_tok_per_s"] / 2), dict(row, repeat=2)]
    (ratio,) = ratio_rows(spec, base)
    assert ratio["ratio_out_tok"] == 2.0 and ratio["ratio_out_tok_range"] == "2..2"
    assert ratio["speedup_tpot_p50_ms"] == pytest.approx((1 + 2) / 2) and ratio["speedup_tpot_p50_ms_range"] == "1..2"
    # a hand-built row has no step clock: NaN; with it, steps saved (60 -> 40 and 60 -> 50) and ms per step paid
    assert math.isnan(ratio["speedup_engine_steps"])
    spec = [dict(row, repeat=1, engine_steps=40, step_ms=12.0), dict(row, repeat=2, engine_steps=50, step_ms=10.0)]
    base = [dict(row, repeat=1, engine_steps=60, step_ms=10.0), dict(row, repeat=2, engine_steps=60, step_ms=10.0)]
    (ratio,) = ratio_rows(spec, base)
    assert ratio["speedup_engine_steps"] == pytest.approx((1.5 + 1.2) / 2)
    assert ratio["speedup_engine_steps_range"] == "1.2..1.5"
    assert ratio["speedup_step_ms"] == pytest.approx((10 / 12 + 1) / 2)
    assert ratio["same_work"] == "-"  # steps but no rows per step: unknown
    # the same steps and rows per step in every repeat: the ratio is the two processes' spread, and says so
    spec = [dict(row, repeat=r, engine_steps=47, rows_per_step=254.0, out_tok_per_s=400.0) for r in (1, 2)]
    base = [dict(row, repeat=1, engine_steps=47, rows_per_step=253.0, out_tok_per_s=440.0),
            dict(row, repeat=2, engine_steps=47, rows_per_step=254.0, out_tok_per_s=400.0)]
    (ratio,) = ratio_rows(spec, base)
    assert ratio["same_work"] == "yes" and ratio["ratio_out_tok"] == pytest.approx((400 / 440 + 1) / 2)
    base[1]["engine_steps"] = 48  # one repeat where speculation saved a step
    assert ratio_rows(spec, base)[0]["same_work"] == "no"
    base[1]["rows_per_step"] = 280.0  # or where the rows differ by more than 1%
    base[1]["engine_steps"] = 47
    assert ratio_rows(spec, base)[0]["same_work"] == "no"
    del base[1]["rows_per_step"]  # no step clock in one repeat: unknown
    assert ratio_rows(spec, base)[0]["same_work"] == "-"

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1 and first_divergence([1, 2], [1, 2, 3]) == 2
    a, b = poisson_arrivals(2.0, 200, seed=3), poisson_arrivals(2.0, 200, seed=3)
    assert a == b and a[0] == 0 and 60 < a[-1] < 140  # seeded; mean gap 0.5 s


def _read(source: str, payloads: list[dict | str]) -> tuple[RequestRecord, _ChunkReader]:
    r = RequestRecord(0, "p", "w", token_source=source)
    reader = _ChunkReader(r, {"usage_chunks": 0, "usage_final": False})
    for t, p in enumerate(payloads):
        reader.feed(p if isinstance(p, str) else json.dumps(p), float(t))
    return r, reader


def test_chunk_reader_counts_tokens_by_each_source() -> None:
    # literal OpenAI chat chunks: a role-only first chunk (no output), then output, then a usage-only chunk
    role = {"choices": [{"delta": {"role": "assistant"}}]}
    # token ids per chunk (verispec's / vLLM's return_token_ids): tokens counted from the ids
    r, rd = _read("token_ids", [role, {"choices": [{"delta": {"content": "ab", "token_ids": [5, 6]}}]},
                                {"choices": [{"delta": {"content": "c", "token_ids": [7]}, "finish_reason": "stop"}]}])
    assert r.chunk_tokens == [2, 1] and rd.ids == [5, 6, 7] and rd.chunk_times == [1.0, 2.0]
    assert "".join(rd.text) == "abc" and r.finish_reason == "stop" and rd.seen["token_ids"] is True
    # per-chunk cumulative usage (vLLM's continuous_usage_stats): the differences, 1 then 3 then 1
    u = lambda n: {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n}  # noqa: E731
    r, rd = _read("continuous_usage", [{"choices": [{"text": "a"}], "usage": u(1)},
                                       {"choices": [{"text": "bcd"}], "usage": u(4)},
                                       {"choices": [{"text": "e"}], "usage": u(5)}, {"choices": [], "usage": u(5)}])
    assert r.chunk_tokens == [1, 3, 1] and rd.final_usage == 5 and r.prompt_tokens == 9
    assert rd.seen["usage_chunks"] == 4
    # no counts from the server: one token per chunk with text; empty content is not output
    delta = lambda text: {"choices": [{"delta": {"content": text}}]}  # noqa: E731
    r, rd = _read("chunks", [role, delta("x"), delta(""), delta("yz")])
    assert r.chunk_tokens == [1, 1] and rd.chunk_times == [1.0, 3.0] and rd.ids == []


def test_chunk_reader_raises_on_error_events_and_malformed_data() -> None:
    with pytest.raises(StreamError, match="engine failed"):
        _read("chunks", [{"error": {"message": "engine failed", "type": "server_error"}}])
    with pytest.raises(StreamError, match="malformed SSE data"):
        _read("chunks", ["{not json"])
    # an error key beside choices is a chunk, not an error event
    r, _ = _read("chunks", [{"error": None, "choices": [{"text": "a"}]}])
    assert r.chunk_tokens == [1]


# ---- a live sweep -------------------------------------------------------------------------------------------
def test_sweep_against_live_server(tiny_dir: Path, tmp_path: Path) -> None:
    # the target as its own draft model: every step drafts (and, at fp32, nearly every draft token is accepted)
    app, engine = make_app(tiny_dir, speculative_config={"method": "draft_model", "model": str(tiny_dir),
                                                         "num_speculative_tokens": 3, "adaptive": False},
                           max_num_seqs=4)
    streams = []
    submit = engine.submit

    def spy(prompt_ids, params, request_id=None):
        s = submit(prompt_ids, params, request_id)
        streams.append((params.max_tokens, s))
        return s

    engine.submit = spy
    # a user's JSONL next to a shipped set (prompts mixed round-robin)
    work = tmp_path / "repeat.jsonl"
    work.write_text("".join(json.dumps({"id": f"rep-{i}", "prompt": "Continue: " + " ".join(
        str(10 + i + j % 5) for j in range(40))}) + "\n" for i in range(4)))
    out = tmp_path / "rep"
    with live(app) as url:
        snap0 = engine.snapshot()
        args = parse(["--endpoint", url + "/v1", "--concurrency", "1,4", "--request-rate", "20",
                      "--requests-per-level", "8", "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
                      "--workloads", f"{work},code", "--no-progress", "--out", str(out),
                      "--max-seconds-per-level", "60", "--slo-ttft", "30", "--warmup-requests", "3"])
        t = time.monotonic()
        assert run_sweep(args) == 0
        took = time.monotonic() - t
        snap1 = engine.snapshot()
    for name in ("report.json", "report.csv", "report.md", "report.html", "throughput_latency.png", "tau.png"):
        assert (out / name).stat().st_size > 200, name
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["conditions"]) == {"concurrency", "metric", "baseline"}
    md = (out / "report.md").read_text()
    assert "concurrency 1, 4" in md and "Poisson" in md and "TPOT" in md

    records = rep["records"]
    assert len(records) == 3 * 8 and {r["level"] for r in records} == {"c=1", "c=4", "rate=20/s"}
    for r in records:
        assert r["status"] == "ok" and r["error_class"] is None, r
        assert r["token_source"] == "token_ids" and r["n_out"] == MAX_TOKENS and len(r["token_ids"]) == MAX_TOKENS
        assert sum(r["chunk_tokens"]) == MAX_TOKENS and r["n_chunks"] == len(r["chunk_tokens"])
        assert len(r["itl_s"]) == MAX_TOKENS - r["chunk_tokens"][0] and len(r["chunk_gaps_s"]) == r["n_chunks"] - 1
        assert 0 < r["headers_s"] <= r["ttft_s"] <= r["e2e_s"] <= r["stream_end_s"] < took
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (MAX_TOKENS - 1), abs=1e-5)
        assert r["identical"] is True and r["first_divergence"] is None  # fp32 greedy: same as at c=1
        assert r["prompt_tokens"] > 0 and r["finish_reason"] == "length"

    rows = [dict(a, **b) for a, b in zip(rep["tables"][0]["rows"], rep["tables"][1]["rows"])]
    assert [r["level"] for r in rows] == ["c=1", "c=4", "rate=20/s"]
    for row in rows:
        assert row["completed"] == 8 and row["errors_by_class"] == "-" and row["identity"] == 1.0
        ttfts = [r["ttft_s"] for r in records if r["level"] == row["level"]]
        assert 0 <= row["queue_mean_ms"] <= max(ttfts) * 1e3  # the server's own wait, within what the client saw
        assert row["out_tok_per_s"] == pytest.approx(8 * MAX_TOKENS / row["duration_s"])
        assert row["goodput_req_per_s"] == pytest.approx(row["req_per_s"])
    assert max(r["max_in_flight"] for r in rows if r["level"] == "c=4") <= 4
    for row in rows:  # the step clock: ms per step is its phases' sum
        assert row["engine_steps"] > 0 and row["step_forward_ms"] > 0
        assert row["step_ms"] == pytest.approx(sum(row[f"step_{p}_ms"] for p in ("schedule", "draft", "forward",
                                                                                 "commit")))
    assert rows[0]["max_in_flight"] == 1

    # /metrics deltas over the levels == the engine's per-request accounting of those requests == its counters
    measured = [s for m, s in streams if m == MAX_TOKENS]
    warm, measured = measured[:3], measured[3:]  # the warm-up's 3 requests come first, and are in no level
    bench = [s.stats for s in measured]
    probe = [s.stats for m, s in streams if m != MAX_TOKENS] + [s.stats for s in warm]
    assert len(bench) == 24 and all(s.stats["output_tokens"] == MAX_TOKENS for s in warm)
    assert any(n.startswith("Warm-up: 3 requests per endpoint") for n in rep["notes"])
    # rows fed to the forwards over the levels: every request's decode rows (its first token, its steps' pending
    # tokens and verified drafts), plus at most its prompt (less where the prefix cache had it)
    fed = sum(r["engine_steps"] * r["rows_per_step"] for r in rows)
    decode_rows = sum(1 + s["steps"] + s["num_draft_tokens"] for s in bench)
    prompts = sum(len(s.prompt_token_ids) - 1 for s in measured)
    assert decode_rows <= round(fed) <= decode_rows + prompts
    drafts = sum(r["drafts"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    draft_tokens = sum(r["draft_tokens"] for r in rows)
    assert draft_tokens == sum(s["num_draft_tokens"] for s in bench) > 24
    assert accepted == sum(s["num_accepted_tokens"] for s in bench) > 0
    probe_tokens = sum(s["num_draft_tokens"] for s in probe)
    assert draft_tokens == snap1.num_draft_tokens - snap0.num_draft_tokens - probe_tokens
    assert accepted == snap1.num_accepted_tokens - snap0.num_accepted_tokens - sum(
        s["num_accepted_tokens"] for s in probe)
    assert drafts <= snap1.num_drafts - snap0.num_drafts
    assert drafts == sum(s._req.spec.drafted_at[0] for s in measured)
    pos_table = next(t["rows"] for t in rep["tables"] if t["title"] == "Per-position acceptance")
    per_pos = [sum(r[f"accepted_pos{i}"] for r in pos_table) for i in range(3)]
    assert per_pos == [sum(s._req.spec.accepted_at[i] for s in measured) for i in range(3)]
    for row in rows:
        assert row["tau"] == pytest.approx(1 + row["accepted"] / row["drafts"]) and row["tau"] > 1.5
    # the report says which weight path the server ran, read from its /metrics (the tiny target runs fp32)
    engine_notes = [n for n in rep["notes"] if n.startswith("Engine ")]
    assert len(engine_notes) == 1 and "weight path fp32 (dtype float32" in engine_notes[0], rep["notes"]
    assert any(n.startswith("machine load over the") for n in rep["notes"]), rep["notes"]


def test_reset_prefix_cache_empties_each_server_before_every_level(tiny_dir: Path, tmp_path: Path,
                                                                   capsys) -> None:
    """--reset-prefix-cache: the second repeat of a level finds nothing its first repeat cached (without it, it
    finds every full block of every prompt but the last token's); against a server without the route the sweep
    stops before measuring, saying how to turn it on."""
    work = tmp_path / "distinct.jsonl"  # two prompts of several 16-token blocks, different from the first words on
    work.write_text("".join(json.dumps({"id": f"d{i}", "prompt": " ".join(f"w{i}{j}" for j in range(30))}) + "\n"
                            for i in range(2)))
    reports = {}
    for reset in (False, True):
        app, _ = make_app(tiny_dir, enable_prefix_caching=True, dev_endpoints=True)
        out = tmp_path / f"reset-{reset}"
        with live(app) as url:
            argv = ["--endpoint", url, "--api", "completions", "--concurrency", "1", "--requests-per-level", "2",
                    "--repeats", "2", "--max-tokens", "3", "--ignore-eos", "--workloads", str(work), "--no-progress",
                    "--out", str(out)] + (["--reset-prefix-cache"] if reset else [])
            assert run_sweep(parse(argv)) == 0
        reports[reset] = json.loads((out / "report.json").read_text())
    for reset, rep in reports.items():
        rows = rep["tables"][0]["rows"]
        second = [r for r in rep["records"] if r["repeat"] == 2]
        full_blocks = sum((r["prompt_tokens"] - 1) // 16 * 16 for r in second)
        assert full_blocks >= 32
        expected = 0.0 if reset else full_blocks / sum(r["prompt_tokens"] for r in second)
        assert [r["repeat"] for r in rows] == [1, 2] and rows[1]["prefix_hit_rate"] == pytest.approx(expected)
        if reset:
            assert rows[0]["prefix_hit_rate"] == 0.0, "the probe's prompt was reset away before the first level"
            assert any("--reset-prefix-cache" in n for n in rep["notes"])

    app, _ = make_app(tiny_dir, enable_prefix_caching=True)  # no dev endpoints: no route
    with live(app) as url:
        argv = ["--endpoint", url, "--api", "completions", "--concurrency", "1", "--requests-per-level", "1",
                "--max-tokens", "2", "--workloads", str(work), "--no-progress", "--reset-prefix-cache",
                "--out", str(tmp_path / "none")]
        assert run_sweep(parse(argv)) == 2
    err = capsys.readouterr().err
    assert "no prefix-cache reset route" in err and "--enable-dev-endpoints" in err
    assert not (tmp_path / "none").exists(), "nothing measured"


# ---- a server that never answers ----------------------------------------------------------------------------
class HangingServer:
    """Accepts connections, reads the request, and never answers (not even headers)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.connections = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while await reader.read(65536):
                pass
        finally:
            writer.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    def __enter__(self) -> str:
        self.thread.start()
        assert self.ready.wait(10)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_bounded_levels_stop_by_themselves_against_a_server_that_never_answers(tmp_path: Path) -> None:
    out = tmp_path / "hang"
    with HangingServer() as url:
        args = parse(["--endpoint", url, "--model", "m", "--concurrency", "3", "--request-rate", "20",
                      "--requests-per-level", "6", "--max-seconds-per-level", "1", "--grace-seconds", "0.5",
                      "--probe-timeout", "0.5", "--metrics-timeout", "0.3", "--no-progress", "--out", str(out)])
        t = time.monotonic()
        rc = run_sweep(args)
        took = time.monotonic() - t
    assert rc == 1  # nothing completed
    # probe + two bounded levels + scrapes + writing the report (slack for a loaded machine); unbounded levels would
    # wait for the 6.5 s request timeout at each level (> 13 s)
    assert took < 0.5 + 2 * (1 + 0.5) + 8, took
    rep = json.loads((out / "report.json").read_text())
    rows = {r["level"]: r for r in rep["tables"][0]["rows"]}
    assert rows["c=3"]["sent"] == 3  # three clients, each stuck on its first request
    assert rows["c=3"]["errors_by_class"] == "timeout=3" and rows["c=3"]["completed"] == 0
    assert 1 <= rows["c=3"]["duration_s"] <= 1.5 + 0.5
    arrivals = [t for t in poisson_arrivals(20, 6, args.seed + 1) if t < 1]
    rate = rows["rate=20/s"]
    assert rate["sent"] == len(arrivals) and rate["errors_by_class"] == f"timeout={len(arrivals)}"
    assert all(r["error_class"] == "timeout" and "cancelled" in r["error"] for r in rep["records"])
    assert math.isnan(rows["c=3"]["tau"]) and rows["c=3"]["identity_n"] == 0
