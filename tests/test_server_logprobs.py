"""Logprobs and `n` choices, on the Python API and both server routes, on the tiny random Llama.

Oracles: HF transformers' forward over prompt + output (log_softmax of its logits: the reference logprobs, their
ranks and top-N), OpenAI's wire shapes written out here, the n = 1 path with seed + i for choice i of n.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from fastapi.testclient import TestClient

from tests.helpers import make_app
from verispec import LLM, SamplingParams

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Count to twenty: one, two, three"}]
PROMPT = [1, 31, 41, 59, 26, 53]  # greedy falls into a 5-token loop: ngram drafts get accepted
TOL = 1e-4


def reference(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: HF's log_softmax of the raw logits each output token was drawn from."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def sse_chunks(text: str) -> list[Any]:
    events = [e for e in text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def chat_ids(tok, messages: list[dict[str, str]]) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


# ---- the engine and the Python API -----------------------------------------------------------------------------
def spec_config(method: str | None, tiny_dir: Path) -> dict | None:
    """ngram drafts on the greedy loop; a draft model that is the target itself (q = p) has sampled drafts
    accepted too, so rejection sampling's accepted, recovered and bonus rows are all exercised."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "draft_model":
        return {"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 3}
    return None


@pytest.fixture(scope="module", params=[None, "ngram", "draft_model"])
def llm(request, tiny_dir: Path) -> LLM:
    return LLM(str(tiny_dir), dtype="float32", progress=False, speculative_config=spec_config(request.param, tiny_dir),
               max_num_seqs=4, scheduler="static")


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (0.05, 0), (1.3, 40)])
def test_api_logprobs_equal_hf(llm: LLM, hf, temperature: float, top_k: int) -> None:
    k = 4
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=20, seed=5, ignore_eos=True, logprobs=k)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert len(out.logprobs) == len(out.token_ids) == 20
    ref = reference(hf, PROMPT, out.token_ids)
    for i, (t, d) in enumerate(zip(out.token_ids, out.logprobs)):
        assert next(iter(d)) == t  # the sampled token first, as vLLM
        assert abs(d[t].logprob - ref[i, t].item()) < TOL, i
        assert int((ref[i] > ref[i, t] + TOL).sum()) + 1 <= d[t].rank <= int((ref[i] >= ref[i, t] - TOL).sum())
        top = torch.topk(ref[i], k)
        ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in d.items() if lp.rank <= k))
        assert [r for r, _, _ in ranked] == list(range(1, k + 1))
        assert [tid for _, tid, _ in ranked] == top.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, _, v in ranked]), top.values, atol=TOL)
        assert all(lp.decoded_token == llm.decode([tid]) for tid, lp in d.items())
    if temperature == 0:  # greedy: the token is the argmax, rank 1
        assert all(d[t].rank == 1 for t, d in zip(out.token_ids, out.logprobs))
    if (llm.spec.method == "ngram" and temperature == 0) or llm.spec.method == "draft_model":
        assert out.stats["num_accepted_tokens"] > 0, "the speculative path was not exercised"


def test_api_without_logprobs_has_none(llm: LLM) -> None:
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert out.logprobs is None and out.outputs[0].logprobs is None


def test_logprobs_param_is_checked() -> None:
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)


# ---- the server ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[None, "ngram"])
def client(request, tiny_dir: Path) -> Iterator[TestClient]:
    app, _ = make_app(tiny_dir, speculative_config=spec_config(request.param, tiny_dir))
    with TestClient(app) as c:
        yield c


def _floats(xs: list[Any]) -> bool:
    return all(isinstance(x, float) for x in xs)


def test_completion_logprobs_format_and_values(client: TestClient, hf, tok) -> None:
    req = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "seed": 3, "ignore_eos": True, "logprobs": 3,
           "return_token_ids": True}
    choice = client.post(C, json=req).json()["choices"][0]
    lp, ids = choice["logprobs"], choice["token_ids"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 12
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert _floats(lp["token_logprobs"]) and all(isinstance(o, int) for o in lp["text_offset"])
    assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:i]) for i in range(12)]
    ref = reference(hf, PROMPT, ids)
    for i, t in enumerate(ids):
        assert abs(lp["token_logprobs"][i] - ref[i, t].item()) < TOL
        top = torch.topk(ref[i], 3)
        want = {tok.decode([j]): v for j, v in zip(top.indices.tolist(), top.values.tolist())}
        want.setdefault(tok.decode([t]), ref[i, t].item())
        got = lp["top_logprobs"][i]
        assert set(got) == set(want) and all(abs(got[s] - want[s]) < TOL for s in want)


def test_chat_logprobs_format_and_values(client: TestClient, hf, tok) -> None:
    req = {"messages": MSGS, "max_completion_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": True,
           "top_logprobs": 5, "return_token_ids": True}
    choice = client.post(CHAT, json=req).json()["choices"][0]
    lp, ids = choice["logprobs"], choice["token_ids"]
    assert set(lp) == {"content", "refusal"} and lp["refusal"] is None and len(lp["content"]) == 10
    ref = reference(hf, chat_ids(tok, MSGS), ids)
    for i, (t, item) in enumerate(zip(ids, lp["content"])):
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["token"] == tok.decode([t]) and item["bytes"] == list(item["token"].encode())
        assert abs(item["logprob"] - ref[i, t].item()) < TOL
        top = torch.topk(ref[i], 5)
        assert [x["token"] for x in item["top_logprobs"]] == [tok.decode([j]) for j in top.indices.tolist()]
        assert all(set(x) == {"token", "logprob", "bytes"} for x in item["top_logprobs"])
        values = [x["logprob"] for x in item["top_logprobs"]]
        assert values == sorted(values, reverse=True) and max(abs(a - b) for a, b in zip(values, top.values)) < TOL
        assert item["top_logprobs"][0]["token"] == item["token"]  # greedy: the token is the most likely
    no_top = client.post(CHAT, json={**req, "top_logprobs": None}).json()["choices"][0]["logprobs"]["content"]
    assert all(x["top_logprobs"] == [] for x in no_top)
    off = client.post(CHAT, json={**req, "logprobs": False, "top_logprobs": 0}).json()["choices"][0]
    assert off["logprobs"] is None


@pytest.mark.parametrize("route", [C, CHAT])
def test_stream_logprobs_equal_whole(client: TestClient, route: str) -> None:
    base = {"max_tokens": 14, "temperature": 1.1, "seed": 9, "ignore_eos": True}
    req = {**base, "prompt": PROMPT, "logprobs": 2} if route == C else \
        {**base, "messages": MSGS, "logprobs": True, "top_logprobs": 2}
    whole = client.post(route, json=req).json()["choices"][0]["logprobs"]
    chunks = sse_chunks(client.post(route, json={**req, "stream": True}).text)
    parts = [c["choices"][0]["logprobs"] for c in chunks[:-1] if c["choices"] and c["choices"][0]["logprobs"]]
    if route == C:
        merged = {k: sum((p[k] for p in parts), []) for k in ("tokens", "token_logprobs", "top_logprobs",
                                                             "text_offset")}
        assert merged == whole
    else:
        assert sum((p["content"] for p in parts), []) == whole["content"]


def test_stop_string_trims_logprobs(client: TestClient) -> None:
    req = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 1,
           "return_token_ids": True}
    full = client.post(C, json=req).json()["choices"][0]
    stop = full["logprobs"]["tokens"][5].strip() or full["logprobs"]["tokens"][5]
    cut = client.post(C, json={**req, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    n = len(cut["token_ids"])
    assert n < 16 and len(cut["logprobs"]["tokens"]) == n
    assert cut["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][:n]


# ---- n choices -------------------------------------------------------------------------------------------------
def test_n_seeded_choices_are_seed_plus_i(client: TestClient) -> None:
    req = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 40, "ignore_eos": True,
           "return_token_ids": True, "logprobs": 0}
    body = client.post(C, json={**req, "n": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    singles = [client.post(C, json={**req, "seed": 40 + i}).json()["choices"][0] for i in range(3)]
    for got, want in zip(body["choices"], singles):
        assert got["token_ids"] == want["token_ids"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        # batched with its siblings vs alone: the same tokens, logprobs equal to float rounding
        assert max(abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"],
                                              want["logprobs"]["token_logprobs"])) < TOL
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) == 3
    assert body["usage"]["completion_tokens"] == 24
    assert body["usage"]["total_tokens"] == 24 + len(PROMPT)
    again = client.post(C, json={**req, "n": 3}).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in body["choices"]]


def test_n_greedy_chat_copies_and_stream(client: TestClient) -> None:
    req = {"messages": MSGS, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 4}
    body = client.post(CHAT, json=req).json()
    msgs = [c["message"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3] and all(m == msgs[0] for m in msgs)
    assert body["usage"]["completion_tokens"] == 24
    chunks = sse_chunks(client.post(CHAT, json={**req, "stream": True,
                                                "stream_options": {"include_usage": True}}).text)
    assert chunks.count("[DONE]") == 1 and chunks[-1] == "[DONE]"
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 24
    text: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for c in chunks[:-2]:
        (ch,) = c["choices"]
        text[ch["index"]] = text.get(ch["index"], "") + (ch["delta"].get("content") or "")
        if ch["finish_reason"]:
            finishes[ch["index"]] = ch["finish_reason"]
    assert text == {i: msgs[0]["content"] for i in range(4)} and finishes == {i: "length" for i in range(4)}


def test_n_limits(client: TestClient) -> None:
    for n in (0, 17, 2.5, "2"):
        r = client.post(C, json={"prompt": "hi", "n": n, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", n
    assert len(client.post(C, json={"prompt": "hi", "n": 16, "max_tokens": 1}).json()["choices"]) == 16


def test_n_stream_equals_whole_per_index(client: TestClient) -> None:
    req = {"prompt": PROMPT, "max_tokens": 7, "temperature": 1.0, "seed": 123, "ignore_eos": True, "n": 3,
           "logprobs": 1, "return_token_ids": True}
    whole = client.post(C, json=req).json()["choices"]
    chunks = sse_chunks(client.post(C, json={**req, "stream": True}).text)
    assert chunks.count("[DONE]") == 1 and chunks[-1] == "[DONE]"
    ids: dict[int, list[int]] = {}
    tokens: dict[int, list[str]] = {}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        ids.setdefault(ch["index"], []).extend(ch["token_ids"])
        if ch["logprobs"]:
            tokens.setdefault(ch["index"], []).extend(ch["logprobs"]["tokens"])
    assert ids == {c["index"]: c["token_ids"] for c in whole}
    assert tokens == {c["index"]: c["logprobs"]["tokens"] for c in whole}


def test_logprobs_survive_preemption(tiny_dir: Path, hf) -> None:
    """A KV pool too small for all five requests preempts and recomputes some: logprobs stay aligned and equal."""
    block = 4
    block_bytes = 2 * 2 * 2 * block * 8 * 4  # K and V x 2 layers x 2 KV heads x 4 positions x head dim 8 x fp32
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=128, block_size=block, max_num_seqs=5,
              kv_cache_memory_bytes=14 * block_bytes, progress=False)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7, 7], [10, 20, 30, 10, 20, 30, 10], list(range(40, 50)),
               list(range(5, 23)) + [5, 6, 7]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (30, 12, 25, 20, 16)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0, "the pool was meant to run out"
    for p, o in zip(prompts, outs):
        ref = reference(hf, p, o.token_ids)
        assert len(o.logprobs) == len(o.token_ids)
        got = torch.tensor([d[t].logprob for t, d in zip(o.token_ids, o.logprobs)])
        want = ref.gather(-1, torch.tensor(o.token_ids).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(got, want, atol=TOL)
