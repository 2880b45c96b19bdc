"""`verispec serve` on the default model as a subprocess, driven by the official `openai` client.

Oracles: the same prompts sent one at a time (for 16 concurrent streams), and `verispec.LLM.generate` in-process
with plain decoding (for the server's speculative greedy output).
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

KEY = "test-key"
MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 16
CTX = 1024
TOPICS = ["caches", "rivers", "compilers", "bread", "tides", "chess", "owls", "glaciers", "jazz", "prime numbers",
          "volcanoes", "origami", "satellites", "tea", "bridges", "bees"]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    # the default scheduler (dspark): it profiles step costs at start-up, within the deadline below
    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--port", "0", "--dtype", "float32", "--method", "ngram",
           "--max-model-len", str(CTX), "--api-key", KEY, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    url, seen, deadline = None, [], time.monotonic() + 240
    while url is None:
        assert proc.poll() is None, "verispec serve exited:\n" + "".join(seen)
        assert time.monotonic() < deadline, "verispec serve did not start in time:\n" + "".join(seen)
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        seen.append(line)
        if line.startswith("verispec: serving") and " at http://127.0.0.1:" in line:
            url = line.split(" at ", 1)[1].split()[0].removesuffix("/v1")
    assert httpx.get(url + "/health").status_code == 200
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def client(base_url: str):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def msgs(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


def stream_chat(client, topic: str, max_tokens: int = MAX_TOKENS) -> tuple[str, list[int]]:
    text, ids = [], []
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs(topic), max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body={"return_token_ids": True}):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            ids += chunk.choices[0].model_extra.get("token_ids", [])
    return "".join(text), ids


def scrape(base_url: str) -> dict[str, float]:
    r = httpx.get(base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if "le" not in s.labels:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_models_and_auth(client, base_url: str) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    bad = openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=CTX + 1)


def test_chat_and_completions_streaming_and_not(client) -> None:
    from transformers import AutoTokenizer

    from verispec.models.loader import resolve

    tok = AutoTokenizer.from_pretrained(str(resolve(MODEL, progress=False).directory))
    chat = client.chat.completions.create(model=MODEL, messages=msgs("caches"), max_tokens=MAX_TOKENS, temperature=0)
    text, _ = stream_chat(client, "caches")
    assert chat.choices[0].message.content == text and text.strip()
    prompt_ids = tok.apply_chat_template(msgs("caches"), add_generation_prompt=True, tokenize=True)["input_ids"]
    assert chat.usage.prompt_tokens == len(prompt_ids)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert 1 <= chat.usage.completion_tokens <= MAX_TOKENS

    prompt = "def fibonacci(n):"
    comp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    assert chunks[-1].usage.completion_tokens == comp.usage.completion_tokens
    assert comp.usage.prompt_tokens == len(tok(prompt)["input_ids"])
    assert comp.choices[0].finish_reason in ("stop", "length")


def test_16_concurrent_streams_equal_single_streams(client, base_url: str) -> None:
    single = [stream_chat(client, t) for t in TOPICS]  # one at a time
    running: list[float] = []
    done = threading.Event()

    def sample() -> None:  # how many requests share the batch while the clients run
        while not done.is_set():
            running.append(scrape(base_url)["verispec:num_requests_running"])
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(len(TOPICS)) as pool:
            concurrent = list(pool.map(lambda t: stream_chat(client, t), TOPICS))
    finally:
        done.set()
        sampler.join()
    assert max(running) >= len(TOPICS) // 2, f"the streams were not batched together: {running}"
    for topic, one, many in zip(TOPICS, single, concurrent):
        assert many == one, f"{topic!r}: concurrent {many!r} != single {one!r}"

    from verispec import LLM, SamplingParams

    llm = LLM(MODEL, dtype="float32", progress=False, max_model_len=CTX, max_num_seqs=1)  # plain decoding
    for topic, (text, ids) in list(zip(TOPICS, single))[:2]:
        ref = llm.chat(msgs(topic), SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
        assert ids == ref.token_ids and text == ref.text


def test_disconnect_mid_stream_frees_the_request(client, base_url: str) -> None:
    before = scrape(base_url)['verispec:request_success_total{finished_reason="abort"}']
    stream = client.completions.create(model=MODEL, prompt="Count from 1 to 500:", max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 1:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while True:
        m = scrape(base_url)
        if m["verispec:num_requests_running"] == 0 and m["verispec:num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, "the abandoned request is still running"
        time.sleep(0.1)
    assert m['verispec:request_success_total{finished_reason="abort"}'] == before + 1
    assert m["verispec:kv_cache_usage_perc"] == 0
