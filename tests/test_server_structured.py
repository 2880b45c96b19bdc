"""Structured outputs and sampling controls through the server, driven by the official `openai` client on a tiny
model served with n-gram speculation: `chat.completions.parse` with a pydantic model, vLLM's structured_outputs,
penalties equal to `LLM.generate` with the same controls (plain decoding, the oracle), 400s naming the field for bad
schemas and grammars while another request decodes."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.helpers import ASK, TIME, WEATHER, live, make_app
from verispec import LLM, SamplingParams

openai = pytest.importorskip("openai")


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)
    kind: str = Field(pattern="^(cat|dog)$")


@pytest.fixture(scope="module")
def served(tiny_dir):
    app, _ = make_app(tiny_dir, {"method": "ngram", "num_speculative_tokens": 4})
    with live(app) as url:  # the app's lifespan starts and stops the engine
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        global MODEL
        MODEL = client.models.list().data[0].id
        yield client, url


MODEL = ""  # the served id, set by the fixture
MSG = [{"role": "user", "content": "Describe a pet as JSON."}]


def test_parse_returns_the_pydantic_object(served):
    client, _ = served
    r = client.chat.completions.parse(model=MODEL, messages=MSG, response_format=Pet, max_tokens=120, temperature=0)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet), r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), Pet.model_json_schema())


def test_json_schema_streamed_and_sampled(served):
    client, _ = served
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9999},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    for seed in range(3):
        stream = client.chat.completions.create(model=MODEL, messages=MSG, response_format=fmt, max_tokens=60,
                                                temperature=1.0, seed=seed, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        jsonschema.validate(json.loads(text), schema)
    r = client.chat.completions.create(model=MODEL, messages=MSG, response_format={"type": "json_object"},
                                       max_tokens=80, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllm_structured_outputs_on_both_routes(served):
    client, _ = served
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = client.completions.create(model=MODEL, prompt="Number:", max_tokens=12, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[1-9][0-9]{2}-[a-z]{3}"}})
    assert re.fullmatch("[1-9][0-9]{2}-[a-z]{3}", r.choices[0].text), r.choices[0].text


def test_penalties_equal_plain_decoding_with_the_same_controls(served, tiny_dir):
    client, _ = served
    controls = dict(presence_penalty=0.5, frequency_penalty=0.4, logit_bias={"300": 5.0},
                    extra_body={"repetition_penalty": 1.3, "min_tokens": 10, "bad_words": ["the"]})
    r = client.completions.create(model=MODEL, prompt="one two three one two three", max_tokens=24, temperature=0,
                                  **controls)
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", progress=False)
    ref = llm.generate("one two three one two three",
                       SamplingParams(temperature=0, max_tokens=24, presence_penalty=0.5, frequency_penalty=0.4,
                                      logit_bias={300: 5.0}, repetition_penalty=1.3, min_tokens=10,
                                      bad_words=["the"]), use_tqdm=False)[0]
    assert r.choices[0].text == ref.text


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"), ({"bad_words": [""]}, "bad_words")])
def test_bad_requests_are_400s_naming_the_field_while_another_decodes(served, extra, param):
    import httpx

    client, url = served
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(client.completions.create, model=MODEL, prompt="Hello", max_tokens=30, temperature=0,
                            extra_body={"ignore_eos": True})
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 5, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()
        assert other.result().usage.completion_tokens == 30, "the request beside it is unharmed"




def _check_calls(calls, tools):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls, "a tool call"
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_calls_validate(served, choice):
    client, _ = served
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                           max_tokens=70, temperature=1.0, seed=seed, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, "required never returns plain text"
        _check_calls(c.message.tool_calls, [WEATHER, TIME])
        assert len(c.message.tool_calls) == 1
        if isinstance(choice, dict):
            assert c.message.tool_calls[0].function.name == "get_time"


def test_tool_calls_streamed_as_deltas(served):
    client, _ = served
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            max_tokens=70, temperature=0, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and calls
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), WEATHER["function"]["parameters"])


def test_auto_and_none_and_bad_tools(served):
    import httpx

    client, url = served
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=30,
                                       temperature=0)
    assert r.choices[0].message.tool_calls or isinstance(r.choices[0].message.content, str)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert not r.choices[0].message.tool_calls
    for bad, param in [({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
                       ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                        "tool_choice"),
                       ({"tool_choice": "required"}, "tool_choice")]:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
