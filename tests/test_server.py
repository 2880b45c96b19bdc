"""The OpenAI-compatible server on a tiny random Llama with the default model's tokenizer.

Oracles: HF transformers' greedy `generate` on the same checkpoint (outputs), the tokenizer on its own (prompt and
text), prometheus-client's own text parser (metrics), and the engine's snapshot (KV and slots freed).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import CTX, EOS, VOCAB, hf_greedy, live, make_app
from verispec import SamplingParams
from verispec.engine.background import BackgroundEngine

METRIC_NAMES = [
    "verispec:spec_decode_num_drafts_total", "verispec:spec_decode_num_draft_tokens_total",
    "verispec:spec_decode_num_accepted_tokens_total", "verispec:time_to_first_token_seconds_bucket",
    "verispec:time_per_output_token_seconds_bucket", "verispec:e2e_request_latency_seconds_bucket",
    "verispec:num_requests_running", "verispec:num_requests_waiting", "verispec:kv_cache_usage_perc",
    "verispec:prompt_tokens_total", "verispec:generation_tokens_total", "verispec:request_success_total",
]
MSGS = [{"role": "user", "content": "Write a haiku about caches."}]


def chat_ids(tok, messages: list[dict[str, str]]) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[tuple[TestClient, BackgroundEngine]]:
    app, engine = make_app(tiny_dir)
    with TestClient(app) as client:
        yield client, engine


@pytest.fixture(scope="module")
def client(served) -> TestClient:
    return served[0]


def metrics(client: Any) -> dict[str, float]:
    """Every sample of /metrics by name and labels, parsed by prometheus-client's own parser."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le")
            if "le" in s.labels:
                continue
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def sse_chunks(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, '[DONE]' kept as a string."""
    events = [e for e in text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


# ---- bad input -------------------------------------------------------------------------------------------------
C, CHAT = "/v1/completions", "/v1/chat/completions"
BAD = [
    (C, b'{"prompt": ', None),
    (C, b"[1, 2]", None),
    (C, b'{"prompt": "hi", "temperature": NaN}', None),
    (C, {}, "prompt"),
    (C, {"prompt": 5}, "prompt"),
    (C, {"prompt": [1.5, 2]}, "prompt"),
    (C, {"prompt": ["a", "b"]}, "prompt"),
    (C, {"prompt": []}, "prompt"),
    (C, {"prompt": ""}, "prompt"),
    (C, {"prompt": [1, VOCAB]}, "prompt"),
    (C, {"prompt": [1] * (CTX + 40)}, "prompt"),
    (C, {"prompt": [1] * CTX, "max_tokens": 1}, "prompt"),
    (C, {"prompt": [1] * (CTX - 6), "max_tokens": 10}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    (C, {"prompt": "hi", "temperature": -0.1}, "temperature"),
    (C, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, "top_p"),
    (C, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (C, {"prompt": "hi", "top_k": -2}, "top_k"),
    (C, {"prompt": "hi", "top_k": 1.5}, "top_k"),
    (C, {"prompt": "hi", "seed": "abc"}, "seed"),
    (C, {"prompt": "hi", "n": 17}, "n"),
    (C, {"prompt": "hi", "stream": "yes"}, "stream"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (C, {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    (C, {"prompt": "hi", "ignore_eos": "no"}, "ignore_eos"),
    (C, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (C, {"prompt": "hi", "stop": ["a", ""]}, "stop"),
    (C, {"prompt": "hi", "logprobs": 6}, "logprobs"),
    (C, {"prompt": "hi", "max_tokenz": 5}, "max_tokenz"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 100_000}, "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "x " * CTX}]}, "messages"),
    (CHAT, {"messages": MSGS, "temperature": -1}, "temperature"),
    (CHAT, {"messages": MSGS, "n": 0}, "n"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize("route,body,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_400_with_openai_error(served, route: str, body: Any, param: str | None) -> None:
    client, engine = served
    before = engine.snapshot().num_finished
    if isinstance(body, bytes):
        r = client.post(route, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and len(err["message"]) > 20
    assert err["param"] == param
    assert engine.snapshot().num_finished == before  # nothing reached the engine


def test_unknown_model_and_route(client: TestClient, tiny_dir: Path) -> None:
    r = client.post(C, json={"prompt": "hi", "model": "gpt-4o", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    served_id = client.get("/v1/models").json()["data"][0]["id"]
    assert served_id == str(tiny_dir)
    for name in (served_id, tiny_dir.name):
        assert client.post(C, json={"prompt": "hi", "model": name, "max_tokens": 1}).status_code == 200
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get(C)
    assert r.status_code == 405 and "error" in r.json()


# ---- outputs against HF ----------------------------------------------------------------------------------------
def test_completion_token_ids_and_text_equal_hf(client: TestClient, hf, tok) -> None:
    ids = [1, 504, 3458, 2683, 359, 253, 1000, 77]
    ref = hf_greedy(hf, ids, 12)
    r = client.post(C, json={"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert choice["token_ids"] == ref
    assert choice["text"] == tok.decode(ref, skip_special_tokens=True)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}


def test_text_prompt_equals_hf(client: TestClient, hf, tok) -> None:
    prompt = "The capital of France is"
    ids = tok(prompt)["input_ids"]
    ref = hf_greedy(hf, ids, 10)
    for p in (prompt, [prompt]):
        body = client.post(C, json={"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}).json()
        assert body["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
        assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 10


def test_stop_token_ids_and_eos_stop_where_hf_says(client: TestClient, hf) -> None:
    ids = [1, 9, 8, 7, 6]
    ref = hf_greedy(hf, ids, 16)
    stop = ref[6]
    cut = next(i for i, t in enumerate(ref) if t in (stop, EOS)) + 1  # EOS stops too without ignore_eos
    body = client.post(C, json={"prompt": ids, "max_tokens": 16, "temperature": 0, "stop_token_ids": [stop],
                                "return_token_ids": True}).json()
    assert body["choices"][0]["token_ids"] == ref[:cut]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == cut


def test_completion_stream_equals_hf(client: TestClient, hf, tok) -> None:
    ids = [1, 31, 41, 59, 26, 53]
    ref = hf_greedy(hf, ids, 14)
    r = client.post(C, json={"prompt": ids, "max_tokens": 14, "temperature": 0, "ignore_eos": True, "stream": True,
                             "stream_options": {"include_usage": True}, "return_token_ids": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(r.text)
    assert chunks[-1] == "[DONE]"
    usage_chunk, deltas = chunks[-2], chunks[:-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 14, "total_tokens": len(ids) + 14}
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in deltas)
    assert len({c["id"] for c in chunks[:-1]}) == 1
    assert "".join(c["choices"][0]["text"] for c in deltas) == tok.decode(ref, skip_special_tokens=True)
    assert sum((c["choices"][0]["token_ids"] for c in deltas), []) == ref
    assert [c["choices"][0]["finish_reason"] for c in deltas] == [None] * (len(deltas) - 1) + ["length"]


def test_chat_equals_hf_streaming_and_not(client: TestClient, hf, tok) -> None:
    ids = chat_ids(tok, MSGS)
    ref_text = tok.decode(hf_greedy(hf, ids, 12), skip_special_tokens=True)
    req = {"messages": MSGS, "max_completion_tokens": 12, "temperature": 0, "ignore_eos": True}
    body = client.post(CHAT, json=req).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ref_text}
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}

    chunks = sse_chunks(client.post(CHAT, json={**req, "stream": True}).text)
    assert chunks[-1] == "[DONE]" and all("usage" not in c for c in chunks[:-1])  # no include_usage: no usage key
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == ref_text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible(client: TestClient) -> None:
    req = {"prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 11,
           "ignore_eos": True, "return_token_ids": True}
    a, b = (client.post(C, json=req).json()["choices"][0]["token_ids"] for _ in range(2))
    assert a == b and len(a) == 8


# ---- auth, overload, engine errors ---------------------------------------------------------------------------
def test_api_key(tiny_dir: Path) -> None:
    app, _ = make_app(tiny_dir, api_key="s3cret")
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        req = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path, kw in (("POST", C, {"json": req}), ("GET", "/v1/models", {}), ("GET", "/metrics", {}),
                                     ("POST", CHAT, {"json": {"messages": MSGS}})):
                r = client.request(method, path, headers=headers, **kw)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        ok = {"Authorization": "Bearer s3cret"}
        assert client.post(C, json=req, headers=ok).status_code == 200
        assert client.get("/v1/models", headers=ok).status_code == 200
        assert client.get("/metrics", headers=ok).status_code == 200


def test_full_queue_is_503_with_retry_after(tiny_dir: Path) -> None:
    app, engine = make_app(tiny_dir, max_num_seqs=1, max_waiting=0)
    client = TestClient(app)  # no lifespan: the engine never starts, so the request below stays in flight
    blocker = engine.submit([1, 2, 3], SamplingParams(max_tokens=4))
    try:
        r = client.post(C, json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "server_overloaded"
    finally:
        blocker.abort()
        engine.shutdown()


def test_engine_error_fails_one_request_only(tiny_dir: Path) -> None:
    app, engine = make_app(tiny_dir)
    real_step, calls = engine.engine.step, []

    def flaky_step() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        real_step()

    engine.engine.step = flaky_step
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post(C, json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "injected failure" in r.json()["error"]["message"]
        assert client.post(C, json={"prompt": "hi", "max_tokens": 3}).status_code == 200
        calls.clear()
        chunks = sse_chunks(client.post(C, json={"prompt": "hi", "max_tokens": 3, "stream": True}).text)
        assert "injected failure" in chunks[-2]["error"]["message"] and chunks[-1] == "[DONE]"
        assert client.get("/health").status_code == 200
        assert engine.snapshot().kv_tokens == 0


# ---- metrics -----------------------------------------------------------------------------------------------------
def test_metrics_names_and_request_accounting(tiny_dir: Path) -> None:
    app, engine = make_app(tiny_dir)
    with TestClient(app) as client:
        prompts = [[1, 5, 9], [1, 7, 7, 7, 7], [1, 2]]
        for ids in prompts:
            assert client.post(C, json={"prompt": ids, "max_tokens": 6, "ignore_eos": True}).status_code == 200
        assert client.post(C, json={"prompt": [1], "max_tokens": 0}).status_code == 400  # not counted
        m = metrics(client)
    text_names = set(m) | {k.split("{")[0] for k in m}
    for name in METRIC_NAMES:
        if not name.endswith("_bucket"):
            assert name in text_names, name
    assert m["verispec:prompt_tokens_total"] == sum(map(len, prompts))
    assert m["verispec:generation_tokens_total"] == 6 * len(prompts)
    assert m['verispec:request_success_total{finished_reason="length"}'] == len(prompts)
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert m[f"verispec:{h}_count"] == len(prompts) and m[f"verispec:{h}_sum"] > 0
    # requests one after another: each waited for admission less than for its first token
    assert m["verispec:request_queue_time_seconds_count"] == len(prompts)
    assert 0 <= m["verispec:request_queue_time_seconds_sum"] < m["verispec:time_to_first_token_seconds_sum"]
    assert m["verispec:num_requests_running"] == 0 and m["verispec:kv_cache_usage_perc"] == 0


def test_spec_metrics_equal_engine_snapshot_and_output_equals_hf(tiny_dir: Path, hf) -> None:
    app, engine = make_app(tiny_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                         "adaptive": False})
    with TestClient(app) as client:
        for ids in ([1, 40, 41, 42, 43, 40, 41, 42, 43, 40, 41], [1, 9, 9, 9, 9, 9, 9]):
            body = client.post(C, json={"prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                        "return_token_ids": True}).json()
            assert body["choices"][0]["token_ids"] == hf_greedy(hf, ids, 24)  # speculation is lossless
        m = metrics(client)
        snap = engine.snapshot()
    assert snap.num_drafts > 0 and snap.num_draft_tokens >= snap.num_drafts
    assert m["verispec:spec_decode_num_drafts_total"] == snap.num_drafts
    assert m["verispec:spec_decode_num_draft_tokens_total"] == snap.num_draft_tokens
    assert m["verispec:spec_decode_num_accepted_tokens_total"] == snap.num_accepted_tokens
    per_pos = [m.get(f'verispec:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}')
               for i in range(len(snap.accepted_per_pos))]
    assert per_pos == snap.accepted_per_pos
    assert sum(snap.accepted_per_pos) == snap.num_accepted_tokens


def test_reset_prefix_cache_route(tiny_dir: Path, client: TestClient) -> None:
    """POST /reset_prefix_cache only with dev endpoints (as vLLM's dev mode): 200 and the next request prefills its
    whole prompt while the Prometheus counters keep counting up; 409 while requests run; 503 without an engine."""
    from concurrent.futures import Future

    assert client.post("/reset_prefix_cache").status_code == 404  # the default server has no such route
    shared = [5 + i % 40 for i in range(40)]  # two full 16-token blocks, then a different tail per request
    app, engine = make_app(tiny_dir, enable_prefix_caching=True, dev_endpoints=True)
    with TestClient(app) as http:
        def send(tail: list[int]) -> tuple[float, float]:
            assert http.post(C, json={"prompt": shared + tail, "max_tokens": 2}).status_code == 200
            wait_idle(engine)
            m = metrics(http)
            return m["verispec:prefix_cache_queries_total"], m["verispec:prefix_cache_hits_total"]

        assert send([7]) == (41, 0) and send([8]) == (82, 32)
        assert http.post("/reset_prefix_cache").status_code == 200
        assert send([9]) == (123, 32), "after the reset nothing is cached, and the counters did not go back"
        assert send([10]) == (164, 64)
        busy: Future = Future()
        busy.set_result(False)  # what the worker answers while requests run (tests/test_paged_engine.py)
        engine.reset_prefix_cache = lambda: busy
        r = http.post("/reset_prefix_cache")
        assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    stopped_app, _ = make_app(tiny_dir, dev_endpoints=True, manage_engine=False)
    with TestClient(stopped_app) as http:
        r = http.post("/reset_prefix_cache")
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


# ---- a live server: disconnects and many requests --------------------------------------------------------------
@pytest.mark.parametrize("caching", [["--enable-dev-endpoints"], ["--no-enable-prefix-caching"]],
                         ids=["default", "no-prefix-caching"])
def test_cli_serve_announces_url_and_stops_on_sigterm(tiny_dir: Path, caching: list[str]) -> None:
    """`verispec serve` prints its URL once bound, answers, shares a prompt prefix between requests unless told not
    to (prefix caching is on by default, as in vLLM's V1 engine), serves POST /reset_prefix_cache only with
    --enable-dev-endpoints, and exits on SIGTERM."""
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--model", str(tiny_dir), "--port", "0", "--device", "cpu",
           "--api-key", "k", "--max-num-seqs", "2", "--scheduler", "static", "--log-level", "warning", *caching]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # the first line printed is the announcement, once the socket is bound
        assert line.startswith("verispec: serving ") and " at http://127.0.0.1:" in line, line
        url = line.split(" at ", 1)[1].split()[0]
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200
        auth = {"Authorization": "Bearer k"}
        r = httpx.post(url + "/completions", json={"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True},
                       headers=auth, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        shared = [5 + i % 40 for i in range(40)]  # two full 16-token blocks, then a different tail per request
        for tail in ([7, 8], [9, 10]):
            r = httpx.post(url + "/completions", json={"prompt": shared + tail, "max_tokens": 2}, headers=auth,
                           timeout=30)
            assert r.status_code == 200
        m = httpx.get(url.removesuffix("/v1") + "/metrics", headers=auth, timeout=30).text
        hits = [float(x.split()[-1]) for x in m.splitlines() if x.startswith("verispec:prefix_cache_hits_total")]
        dev = "--enable-dev-endpoints" in caching
        assert hits == [0.0 if not dev else 32.0], hits
        r = httpx.post(url.removesuffix("/v1") + "/reset_prefix_cache", headers=auth, timeout=30)
        assert r.status_code == (200 if dev else 404), r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()


def wait_idle(engine: BackgroundEngine, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        snap = engine.snapshot()
        if snap.num_running == 0 and snap.num_waiting == 0 and snap.kv_tokens == 0:
            return snap
        assert time.monotonic() < deadline, f"requests still hold the engine: {snap}"
        time.sleep(0.02)


def test_disconnect_mid_stream_aborts_the_request(tiny_dir: Path) -> None:
    app, engine = make_app(tiny_dir)
    with live(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        req = {"prompt": [1, 2, 3], "max_tokens": CTX - 3, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=req) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = []
            for line in lines:
                if line.startswith("data: "):
                    got.append(line)
                if len(got) == 2:
                    break
        wait_idle(engine)  # closing the response freed the slot and the KV
        # a non-streaming client that gives up is aborted too
        with pytest.raises(httpx.TimeoutException):
            http.post("/v1/completions", json={**req, "stream": False}, timeout=0.05)
        wait_idle(engine)
        m = metrics(http)
    assert m['verispec:request_success_total{finished_reason="abort"}'] == 2
    assert m["verispec:generation_tokens_total"] < 2 * (CTX - 3)
    assert m["verispec:num_requests_running"] == 0


def test_200_short_requests_leave_no_kv(tiny_dir: Path) -> None:
    app, engine = make_app(tiny_dir, max_num_seqs=8)

    def one(i: int, http: httpx.Client) -> int:
        req = {"prompt": [1, 100 + i % 50, 7], "max_tokens": 1 + i % 4, "ignore_eos": True,
               "temperature": 0 if i % 2 else 0.8, "seed": i}
        if i % 3 == 0:
            with http.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
                for line in r.iter_lines():
                    if i % 9 == 0 and line.startswith("data: "):
                        return -1  # leaves mid-stream
            return r.status_code
        return http.post("/v1/completions", json=req).status_code

    with live(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda i: one(i, http), range(200)))
        snap = wait_idle(engine)
        m = metrics(http)
    assert set(codes) <= {200, -1} and codes.count(-1) == len(range(0, 200, 9))
    assert snap.kv_usage == 0 and m["verispec:kv_cache_usage_perc"] == 0
    finished = sum(m[f'verispec:request_success_total{{finished_reason="{r}"}}'] for r in ("stop", "length", "abort"))
    assert finished == 200
