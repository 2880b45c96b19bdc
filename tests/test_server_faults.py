"""Regression tests for faults found by attacking `verispec serve`, each sending the request that broke it.

Oracles: HF transformers' greedy `generate` (a top_p that keeps one token is greedy), the same requests run alone
(isolation of a failing request), the tokenizer call log (what was never tokenised) and wall-clock ordering
(the event loop answers /health while a prompt is tokenised).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from tests.helpers import CTX, counting_tokenizer, hf_greedy, make_app, serving
from tests.helpers import live as live_app
from verispec import LLM, SamplingParams
from verispec.sampling import target_probs

C, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client(tiny_dir: Path) -> Iterator[TestClient]:
    app, _ = make_app(tiny_dir)
    with TestClient(app) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: Any = "any") -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and len(err["message"]) > 20
    if param != "any":
        assert err["param"] == param, err
    return err


def sse_payloads(lines: list[str]) -> list[Any]:
    return [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]


# ---- 1. a top_p below float32's smallest value; one request's failure stays its own ----------------------------
def test_top_p_that_rounds_to_zero_keeps_the_top_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 97) * 3
    for top_p in (1e-300, 1e-46, 1e-45, 1e-9):
        p = target_probs(logits, 0.7, top_p=top_p)
        assert torch.isfinite(p).all()
        assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 97).float())


def test_top_p_1e300_request_is_greedy(client: TestClient, hf, tok) -> None:
    r = client.post(C, json={"prompt": "Hi", "max_tokens": 4, "temperature": 0.7, "top_p": 1e-300})
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 4
    ids = list(tok("Hi")["input_ids"])
    r = client.post(C, json={"prompt": "Hi", "max_tokens": 4, "temperature": 0.7, "top_p": 1e-300,
                             "ignore_eos": True, "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(hf, ids, 4)  # only the top token survives: greedy


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}])
def test_one_failing_request_leaves_the_batch_alone(tiny_dir: Path, monkeypatch, spec) -> None:
    import verispec.engine.core as core

    llm = LLM(str(tiny_dir), dtype="float32", progress=False, scheduler="static", max_num_seqs=4,
              speculative_config=spec)
    prompts = [{"prompt_token_ids": [1, 40, 41, 42, 40, 41, 42]}, {"prompt_token_ids": [1, 7, 8]},
               {"prompt_token_ids": [1, 9, 9, 9, 9]}]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5),
              SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7)]
    alone = [llm.generate(p, q, use_tqdm=False)[0].token_ids for p, q in zip(prompts, params)]
    real_verify, calls = core.verify, []

    def poisoned(draft, probs, logits, p, *args):
        if p is params[1]:
            calls.append(1)
            if len(calls) == 3:  # mid-generation, after two of its steps went through
                raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_verify(draft, probs, logits, p, *args)

    monkeypatch.setattr(core, "verify", poisoned)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].finish_reason == "error" and len(outs[1].token_ids) < 12
    assert [outs[0].token_ids, outs[2].token_ids] == [alone[0], alone[2]]
    assert outs[0].finish_reason == outs[2].finish_reason == "length"
    assert not llm.engine.running and llm.engine.kv_tokens() == 0  # its slot and KV were freed
    monkeypatch.setattr(core, "verify", real_verify)
    again = llm.generate(prompts, params, use_tqdm=False)  # every slot is usable again
    assert [o.token_ids for o in again] == alone


def test_failing_request_gets_its_error_and_others_their_output(tiny_dir: Path, monkeypatch, hf) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import verispec.engine.core as core

    app, engine = make_app(tiny_dir)
    slow_steps(engine, 0.01)  # the three requests overlap in the batch
    real_verify = core.verify

    def poisoned(draft, probs, logits, p, *args):
        if p.seed == 666:
            raise RuntimeError("injected sampling failure")
        return real_verify(draft, probs, logits, p, *args)

    monkeypatch.setattr(core, "verify", poisoned)
    prompts = [[1, 5, 6], [1, 9, 8, 7]]
    good = [{"prompt": ids, "max_tokens": 16, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
            for ids in prompts]
    bad = {**good[0], "seed": 666, "temperature": 0.5}
    with live_app(app) as url, httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(3) as pool:
        rs = list(pool.map(lambda body: http.post(C, json=body), [good[0], bad, good[1]]))
    err = assert_error(rs[1], 500)
    assert "injected sampling failure" in err["message"] and err["code"] == "engine_error"
    for r, ids in zip([rs[0], rs[2]], prompts):
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == hf_greedy(hf, ids, 16)
    assert engine.snapshot().kv_tokens == 0


# ---- 2. lone UTF-16 surrogates -----------------------------------------------------------------------------------
@pytest.mark.parametrize("route,raw,param", [
    (C, b'{"prompt":"\\ud800x"}', "prompt"),
    (C, b'{"prompt":["\\udfffx"]}', "prompt[0]"),
    (CHAT, b'{"messages":[{"role":"user","content":"\\ud800x"}]}', "messages[0].content"),
    (CHAT, b'{"messages":[{"role":"user","content":[{"type":"text","text":"a\\ud800"}]}]}',
     "messages[0].content[0].text"),
    (C, b'{"prompt":"hi","model":"\\ud800"}', "model"),
])
def test_lone_surrogate_is_400_naming_the_field(client: TestClient, route: str, raw: bytes, param: str) -> None:
    err = assert_error(client.post(route, content=raw, headers=JSON), 400, param)
    assert "surrogate" in err["message"]


def test_surrogate_pair_is_text(client: TestClient, tok) -> None:
    r = client.post(C, content=b'{"prompt":"\\ud83d\\ude00 hi","max_tokens":1,"return_token_ids":true}', headers=JSON)
    assert r.status_code == 200, r.text


# ---- 3. deep nesting ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [100_000, 2_000, 100])
def test_deeply_nested_json_is_400(client: TestClient, depth: int) -> None:
    raw = b'{"prompt":' + b"[" * depth + b"]" * depth + b"}"
    err = assert_error(client.post(C, content=raw, headers=JSON), 400)
    assert "nest" in err["message"]


# ---- 4. body size, prompt bytes, tokenising off the event loop ---------------------------------------------------
def test_5mb_prompt_is_413_up_front(client: TestClient) -> None:
    r = client.post(C, json={"prompt": "a" * (5 * 1024 * 1024)})
    err = assert_error(r, 413, None)
    assert err["code"] == "request_too_large" and "max-request-bytes" in err["message"]


def test_streamed_body_is_counted(tiny_dir: Path) -> None:
    app, _ = make_app(tiny_dir, max_request_bytes=1000)
    chunks = [b'{"prompt": "'] + [b"a" * 200] * 10 + [b'"}']
    with TestClient(app) as c:
        r = c.post(C, content=iter(chunks), headers=JSON)  # no Content-Length: chunked
        assert "content-length" not in r.request.headers
        assert_error(r, 413, None)
        assert c.post(C, content=iter([b'{"prompt": [1, 2], ', b'"max_tokens": 1}']), headers=JSON).status_code == 200


def test_prompt_longer_than_the_context_could_hold_is_never_tokenised(tiny_dir: Path) -> None:
    from verispec.server.limits import prompt_byte_limit

    app, _ = make_app(tiny_dir, max_request_bytes=64 * 1024 * 1024)
    llm = app.state.llm
    limit = prompt_byte_limit(llm)
    assert limit >= CTX * 16  # the default tokenizer's longest entry is over 16 bytes
    calls = counting_tokenizer(llm)
    with TestClient(app) as c:
        assert_error(c.post(C, json={"prompt": "a" * (limit + 1)}), 400, "prompt")
        assert_error(c.post(CHAT, json={"messages": [{"role": "user", "content": "é" * (limit // 2 + 1)}]}), 400,
                     "messages")
        assert calls == []
        assert_error(c.post(C, json={"prompt": "a b " * (CTX + 10)}), 400, "prompt")  # fits the bound: tokenised
        assert calls != []


class SlowTokenizer:
    """The real tokenizer, taking `delay` seconds per call (a huge prompt); `inside` is set during a call."""

    def __init__(self, real: Any, delay: float) -> None:
        self.real, self.delay = real, delay
        self.inside, self.done = threading.Event(), threading.Event()

    def __call__(self, text, **kw):
        self.inside.set()
        time.sleep(self.delay)
        self.done.set()
        return self.real(text, **kw)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_health_answers_while_a_prompt_is_tokenised(tiny_dir: Path) -> None:
    app, _ = make_app(tiny_dir)
    slow = SlowTokenizer(app.state.llm.tokenizer, delay=3.0)
    app.state.llm.tokenizer = slow
    with serving(app) as (url, _, _), httpx.Client(base_url=url, timeout=30) as http:
        big: dict[str, Any] = {}
        t = threading.Thread(target=lambda: big.setdefault("r", http.post(C, json={"prompt": "x y", "max_tokens": 1})))
        t.start()
        assert slow.inside.wait(10)
        h = http.get("/health")
        assert h.status_code == 200 and not slow.done.is_set()  # answered while the tokenizer was still busy
        t.join(30)
        assert big["r"].status_code == 200


def test_cli_serve_takes_the_new_flags() -> None:
    from verispec.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-request-bytes", "1000", "--shutdown-timeout", "2.5"])
    assert args.max_request_bytes == 1000 and args.shutdown_timeout == 2.5


# ---- 5. graceful shutdown -------------------------------------------------------------------------------------------
class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def captured_logs() -> Iterator[LogRecords]:
    h = LogRecords()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "verispec")]
    for lg in loggers:
        lg.addHandler(h)
    try:
        yield h
    finally:
        for lg in loggers:
            lg.removeHandler(h)


def slow_steps(engine, seconds: float) -> None:
    real = engine.engine.step

    def step() -> None:
        time.sleep(seconds)
        real()

    engine.engine.step = step


def start_stream(http: httpx.Client, body: dict[str, Any]) -> tuple[Any, list[str]]:
    """Open a streaming request and read until its first data line; returns (response context, lines so far)."""
    cm = http.stream("POST", C, json={**body, "stream": True})
    r = cm.__enter__()
    assert r.status_code == 200
    lines_iter = r.iter_lines()
    lines = []
    for line in lines_iter:
        lines.append(line)
        if line.startswith("data: "):
            break
    return (cm, lines_iter), lines


def finish_stream(handle, lines: list[str]) -> list[Any]:
    cm, it = handle
    lines += list(it)
    cm.__exit__(None, None, None)
    return sse_payloads(lines)


def test_shutdown_lets_running_streams_finish_and_refuses_new_requests(tiny_dir: Path) -> None:
    app, engine = make_app(tiny_dir)
    slow_steps(engine, 0.03)
    req = {"prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    with captured_logs() as logs, serving(app, shutdown_timeout=30) as (url, server, thread), \
            httpx.Client(base_url=url, timeout=30) as http:
        handle, lines = start_stream(http, req)
        server.should_exit = True
        deadline = time.monotonic() + 5
        while not app.state.lifecycle.draining:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with httpx.Client(base_url=url, timeout=10) as other:  # a new connection while the drain runs
            late = other.post(C, json={"prompt": [1, 2], "max_tokens": 2})
            assert other.get("/health").status_code == 503
        err = assert_error(late, 503)
        assert err["code"] == "server_shutting_down" and int(late.headers["retry-after"]) >= 1
        chunks = finish_stream(handle, lines)
        thread.join(30)
        assert not thread.is_alive()
    assert chunks[-1] == "[DONE]"
    tokens = [t for c in chunks[:-1] for t in c["choices"][0].get("token_ids", [])]
    assert len(tokens) == 40 and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert not [r for r in logs.records if r.exc_info or r.levelno >= logging.ERROR]


def test_shutdown_timeout_ends_the_rest_with_openai_errors(tiny_dir: Path) -> None:
    app, engine = make_app(tiny_dir)
    slow_steps(engine, 0.05)
    req = {"prompt": [1, 2, 3], "max_tokens": CTX - 3, "ignore_eos": True}
    with captured_logs() as logs, serving(app, shutdown_timeout=0.3) as (url, server, thread), \
            httpx.Client(base_url=url, timeout=30) as http:
        plain: dict[str, Any] = {}
        t = threading.Thread(target=lambda: plain.setdefault("r", http.post(C, json=req)))
        t.start()
        handle, lines = start_stream(http, req)
        t0 = time.monotonic()
        server.should_exit = True
        chunks = finish_stream(handle, lines)
        t.join(30)
        thread.join(30)
        assert not thread.is_alive() and time.monotonic() - t0 < 10
    assert chunks[-1] == "[DONE]" and "error" in chunks[-2], chunks[-3:]
    assert chunks[-2]["error"]["code"] == "server_shutting_down" and "shutting down" in chunks[-2]["error"]["message"]
    assert_error(plain["r"], 503)["code"] == "server_shutting_down"
    assert not [r for r in logs.records if r.exc_info or r.levelno >= logging.ERROR]
    assert engine.snapshot().kv_tokens == 0


def test_sigterm_ends_streams_with_done_and_no_traceback(tiny_dir: Path) -> None:
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--model", str(tiny_dir), "--port", "0", "--device", "cpu",
           "--max-num-seqs", "2", "--scheduler", "static", "--shutdown-timeout", "0.2", "--log-level", "info"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split(" at ", 1)[1].split()[0]
        with httpx.Client(base_url=url.removesuffix("/v1"), timeout=30) as http:
            handle, lines = start_stream(http, {"prompt": [1, 2, 3], "max_tokens": CTX - 3, "ignore_eos": True})
            proc.send_signal(signal.SIGTERM)
            chunks = finish_stream(handle, lines)
        assert chunks[-1] == "[DONE]"
        assert "error" in chunks[-2] or chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) in (0, -signal.SIGTERM)
        err = proc.stderr.read()
        assert "Traceback" not in err and "ERROR" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- 6. max_tokens beside max_completion_tokens ----------------------------------------------------------------------
@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": "abc", "max_completion_tokens": 5}, "max_tokens"),
    ({"max_tokens": 0, "max_completion_tokens": 5}, "max_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": "abc"}, "max_completion_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 1.5}, "max_completion_tokens"),
])
def test_both_token_limits_are_validated(client: TestClient, extra: dict[str, Any], param: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], **extra}
    assert_error(client.post(CHAT, json=body), 400, param)
    ok = client.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7,
                                 "max_completion_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
