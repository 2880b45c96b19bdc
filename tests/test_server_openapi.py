"""The served /openapi.json and /v1/models/{id}, on the tiny random Llama.

Oracles: jsonschema validating real responses and bodies against the served schemas, the OpenAI python client's
own pydantic types parsing the responses (field names and types as OpenAI's, logprobs included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from fastapi.testclient import TestClient

from tests.helpers import VOCAB, make_app

jsonschema = pytest.importorskip("jsonschema")

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def client(tiny_dir: Path) -> Iterator[TestClient]:
    app, _ = make_app(tiny_dir)
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def spec(client: TestClient) -> dict[str, Any]:
    r = client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def validator(spec: dict[str, Any], name: str):
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", **spec})


def test_schema_documents_both_post_routes(spec: dict[str, Any]) -> None:
    assert spec["openapi"].startswith("3.")
    for path, req, resp in ((C, "CompletionRequest", "CompletionResponse"),
                            (CHAT, "ChatCompletionRequest", "ChatCompletionResponse")):
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{req}"}
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{resp}"}
        assert "text/event-stream" in ok
        for code in ("400", "404", "503"):
            assert op["responses"][code]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["prompt"]["anyOf"][1]["items"]["maximum"] == VOCAB - 1
    assert props["n"]["anyOf"][0]["maximum"] == 16 and props["logprobs"]["anyOf"][0]["maximum"] == 5
    jsonschema.Draft202012Validator.check_schema(spec["components"]["schemas"]["ChatCompletionRequest"])


REQUESTS = [
    (C, {"prompt": "Hello", "max_tokens": 4, "logprobs": 2, "n": 2, "seed": 1, "return_token_ids": True}),
    (C, {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3, "n": 2}),
    (CHAT, {"messages": MSGS, "max_tokens": 3, "temperature": 0, "stop": ["\n"]}),
]


@pytest.mark.parametrize("route,body", REQUESTS)
def test_responses_fit_the_schema_and_openai_types(client: TestClient, spec: dict[str, Any], route: str,
                                                   body: dict[str, Any]) -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    chat = route == CHAT
    validator(spec, "ChatCompletionRequest" if chat else "CompletionRequest").validate(body)
    r = client.post(route, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    validator(spec, "ChatCompletionResponse" if chat else "CompletionResponse").validate(out)
    parsed = (ChatCompletion if chat else Completion).model_validate(out)
    assert len(parsed.choices) == body.get("n", 1)
    if body.get("logprobs"):
        lp = parsed.choices[0].logprobs
        if chat:
            assert lp.content and len(lp.content[0].top_logprobs) == body["top_logprobs"]
            assert isinstance(lp.content[0].logprob, float) and isinstance(lp.content[0].bytes, list)
        else:
            assert lp.tokens and len(lp.token_logprobs) == len(lp.tokens) == len(lp.text_offset)


def test_bad_bodies_break_the_schema_and_get_400(client: TestClient, spec: dict[str, Any]) -> None:
    for route, body in ((C, {"prompt": "hi", "n": 17}), (C, {"prompt": "hi", "logprobs": 6}),
                        (CHAT, {"messages": MSGS, "top_logprobs": 21, "logprobs": True}),
                        (C, {"prompt": "hi", "bogus": 1})):
        v = validator(spec, "ChatCompletionRequest" if route == CHAT else "CompletionRequest")
        assert not v.is_valid(body), body
        r = client.post(route, json=body)
        assert r.status_code == 400, body
        validator(spec, "Error").validate(r.json())


def test_model_by_id(client: TestClient, tiny_dir: Path) -> None:
    card = client.get("/v1/models").json()["data"][0]
    for name in (card["id"], tiny_dir.name, tiny_dir.name.upper()):
        r = client.get(f"/v1/models/{name}")
        assert r.status_code == 200 and r.json() == card, name
    r = client.get("/v1/models/gpt-4o")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
