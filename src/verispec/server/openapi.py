"""The served /openapi.json: JSON schemas of the request bodies of both POST routes, their responses (JSON and
SSE) and the error body, for clients, generators and fuzzers (tests/test_server_fuzz.py runs schemathesis on it).

The routes read raw JSON and validate it by hand (server/protocol.py); that stays the authority. These schemas
describe what it accepts, with this model's limits (context length, vocabulary) filled in.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from verispec.server.bounds import (MAX_METADATA_KEY_CHARS, MAX_METADATA_KEYS, MAX_METADATA_VALUE_CHARS,
                                    MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS)
from verispec.server.logprobs import MAX_CHAT_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS
from verispec.server.structured import controls_schema

REF = "#/components/schemas/"
ROLES = ["system", "developer", "user", "assistant", "tool"]


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF + name}


def _nullable(schema: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}], **kw}


def _sampling(max_model_len: int, vocab: int, max_n: int) -> dict[str, Any]:
    """The fields both routes take."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
    return {
        "model": _nullable({"type": "string"}, description="the served model's id or an alias (optional)"),
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": max_model_len},
                                description="tokens to generate; prompt + max_tokens must fit the context"),
        "temperature": _nullable({"type": "number", "minimum": 0}, description="0 = greedy; default 1"),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1}, description="0 or -1: no limit"),
        "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1},
                          description="reproducible sampling; choice i of n uses seed + i"),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": max_n}, description="choices to return"),
        "stream": _nullable({"type": "boolean"}, description="server-sent events, ending with `data: [DONE]`"),
        "stream_options": _nullable({"type": "object", "additionalProperties": False, "properties": {
            "include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}},
            description="only with stream: true"),
        "stop": _nullable({"anyOf": [{"type": "string", "maxLength": MAX_STOP_CHARS},
                                     {"type": "array", "maxItems": MAX_STOP_STRINGS,
                                      "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}}]}),
        "include_stop_str_in_output": _nullable({"type": "boolean"}),
        "stop_token_ids": _nullable({**ids, "maxItems": MAX_STOP_TOKEN_IDS}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "return_token_ids": _nullable({"type": "boolean"}, description="each choice's token ids (vLLM)"),
        **controls_schema(vocab),
        "user": {"type": "string", "description": "ignored"},
        "metadata": _nullable({"type": "object", "maxProperties": MAX_METADATA_KEYS,
                               "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
                               "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS}},
                              description="ignored; OpenAI's limits"),
    }


def request_schemas(max_model_len: int, vocab: int, max_n: int) -> dict[str, Any]:
    common = _sampling(max_model_len, vocab, max_n)
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ROLES},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}],
                    "description": "text, or text parts (joined by newlines); an assistant's may also be null"}}}
    completion = {"type": "object", "additionalProperties": False, "required": ["prompt"], "properties": {
        "prompt": {"anyOf": [{"type": "string", "minLength": 1}, ids,
                             {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}}],
                   "description": "text, token ids, or a list of one text"},
        **common,
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS},
                              description="logprobs of each token and the N most likely (log_softmax of the raw "
                                          "logits, as vLLM)"),
    }}
    chat = {"type": "object", "additionalProperties": False, "required": ["messages"], "properties": {
        "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        **common,
        "max_completion_tokens": common["max_tokens"],
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_CHAT_TOP_LOGPROBS},
                                  description="needs logprobs: true"),
        "split_special_tokens": _nullable({"type": "boolean"}, description=(
            "true: special tokens typed in the messages' text (e.g. <|im_end|>) are tokenised as plain text; "
            "default false, as vLLM: they are parsed as the special tokens")),
    }}
    return {"CompletionRequest": completion, "ChatCompletionRequest": chat, "ChatMessage": message}


def response_schemas() -> dict[str, Any]:
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    top = {"type": "object", "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                                            "bytes": {"type": "array", "items": {"type": "integer"}}}}
    chat_lp = {"type": "object", "properties": {"content": {"type": "array", "items": {
        **top, "properties": {**top["properties"], "top_logprobs": {"type": "array", "items": top}}}}}}
    comp_lp = {"type": "object", "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": "number"}},
        "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "number"}}},
        "text_offset": {"type": "array", "items": {"type": "integer"}}}}
    finish = _nullable({"enum": ["stop", "length", "abort"]})
    base = {"index": {"type": "integer"}, "finish_reason": finish, "stop_reason": _nullable({"type": "string"}),
            "token_ids": {"type": "array", "items": {"type": "integer"}}}

    def body(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                               "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                               "usage": usage}}

    message = {"type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}
    model = {"type": "object", "required": ["id", "object"], "properties": {
        "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
        "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"}, "param": _nullable({"type": "string"}),
            "code": _nullable({"type": "string"})}}}}
    return {
        "CompletionResponse": body("text_completion", {"type": "object", "properties": {
            **base, "text": {"type": "string"}, "logprobs": _nullable(comp_lp)}}),
        "ChatCompletionResponse": body("chat.completion", {"type": "object", "properties": {
            **base, "message": message, "logprobs": _nullable(chat_lp)}}),
        "Model": model,
        "ModelList": {"type": "object", "properties": {"object": {"const": "list"},
                                                       "data": {"type": "array", "items": _ref("Model")}}},
        "Error": error,
    }


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*codes: int) -> dict[str, Any]:
    what = {400: "invalid request (`error.param` names the field)", 401: "missing or wrong API key",
            404: "unknown model", 413: "request body too large", 503: "overloaded (Retry-After) or shutting down",
            500: "the engine failed on this request"}
    return {str(c): {"description": what[c], "content": _json(_ref("Error"))} for c in codes}


def _generate_op(request: str, response: str) -> dict[str, Any]:
    ok = {"description": "the completion; with stream: true, server-sent events of chunks, then `data: [DONE]`",
          "content": {**_json(_ref(response)), "text/event-stream": {"schema": {"type": "string"}}}}
    return {"requestBody": {"required": True, "content": _json(_ref(request))},
            "responses": {"200": ok, **_errors(400, 401, 404, 413, 500, 503)}}


def build_openapi(app: FastAPI, max_model_len: int, vocab: int, max_n: int) -> dict[str, Any]:
    """FastAPI's schema of the routes, with the bodies the handlers parse by hand and their responses added."""
    schema = get_openapi(title="verispec", version=app.version, routes=app.routes,
                         description="OpenAI-compatible API over verispec's speculative-decoding engine.")
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps.update(request_schemas(max_model_len, vocab, max_n))
    comps.update(response_schemas())
    paths = schema["paths"]
    for path, req, resp in (("/v1/completions", "CompletionRequest", "CompletionResponse"),
                            ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse")):
        paths[path]["post"].update(_generate_op(req, resp))
    paths["/v1/models"]["get"]["responses"] = {"200": {"description": "the served model",
                                                       "content": _json(_ref("ModelList"))}, **_errors(401)}
    for p in paths:
        if p.startswith("/v1/models/"):
            paths[p]["get"]["responses"] = {"200": {"description": "the model card", "content": _json(_ref("Model"))},
                                            **_errors(401, 404)}
    schema["components"]["schemas"].pop("HTTPValidationError", None)
    schema["components"]["schemas"].pop("ValidationError", None)
    return schema


def install_openapi(app: FastAPI, max_model_len: int, vocab: int, max_n: int) -> None:
    """Serve build_openapi's schema at app.openapi_url (built once, on first request)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, max_model_len, vocab, max_n)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
