"""The request fields of structured outputs and sampling controls on the wire, into SamplingParams fields.

  response_format     - OpenAI's: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
                        "json_schema": {"name", "schema", "strict"}} (chat and, as vLLM takes it, completions);
  structured_outputs  - vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...};
  presence_penalty, frequency_penalty (OpenAI's [-2, 2]), repetition_penalty (vLLM's, (0, 2]), logit_bias
  ({"token id": bias in [-100, 100]}), min_tokens, bad_words (vLLM's).
Every problem is a 400 naming the field, raised before the request reaches the engine: a schema or grammar is
compiled here (cached), so a bad one never occupies a decoding slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from verispec.sampling.grammar import GrammarError, StructuredOutputsParams

if TYPE_CHECKING:
    from verispec.api import LLM

KEYS = {"response_format", "structured_outputs", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "min_tokens", "bad_words"}
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias keys
MAX_BAD_WORDS = 64
MAX_GRAMMAR_CHARS = 65536  # a schema's or grammar's text: compiled per request


def _response_format(v: Any, bad: Callable[..., Exception]) -> StructuredOutputsParams | None:
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise bad("'response_format' must be an object like {\"type\": \"json_object\"}.", "response_format")
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}.",
                  "response_format.type")
    js = v.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise bad("'response_format.json_schema' must be an object with 'name' and 'schema' (a JSON schema object).",
                  "response_format.json_schema")
    schema = js.get("schema", {})  # OpenAI: absent means any JSON object
    return StructuredOutputsParams(json=schema if schema else {"type": "object"})


def _structured(body: dict, bad: Callable[..., Exception]) -> tuple[StructuredOutputsParams | None, str]:
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and so is not None:
        spec = _response_format(fmt, bad)
        if spec is not None:
            raise bad("Send either 'response_format' or 'structured_outputs', not both.", "structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'structured_outputs' must be an object like {\"regex\": \"[0-9]+\"}.", "structured_outputs")
        try:
            return StructuredOutputsParams.from_any(so), "structured_outputs"
        except (GrammarError, TypeError) as e:
            raise bad(f"'structured_outputs': {e}.", "structured_outputs") from None
    if fmt is not None:
        return _response_format(fmt, bad), "response_format"
    return None, ""


def parse_controls(body: dict, llm: "LLM", bad: Callable[..., Exception]) -> dict[str, Any]:
    """The SamplingParams fields these body fields set (only those present), validated against the model: its
    vocabulary for logit_bias, its tokenizer for grammars; 400s name the field."""
    out: dict[str, Any] = {}
    for key, lo, hi in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("repetition_penalty", 0, 2)):
        v = body.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi or (key[0] == "r" and v <= 0):
            what = "in (0, 2]" if key == "repetition_penalty" else "in [-2, 2]"
            raise bad(f"'{key}' must be a number {what}, got {v!r}.", key)
        out[key] = float(v)
    if body.get("min_tokens") is not None:
        v = body["min_tokens"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad(f"'min_tokens' must be an integer >= 0, got {v!r}.", "min_tokens")
        out["min_tokens"] = v
    if body.get("logit_bias") is not None:
        out["logit_bias"] = _logit_bias(body["logit_bias"], llm.model.cfg.vocab_size, bad)
    if body.get("bad_words") is not None:
        words = body["bad_words"]
        words = [words] if isinstance(words, str) else words
        if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
            raise bad("'bad_words' must be a list of non-empty strings.", "bad_words")
        if len(words) > MAX_BAD_WORDS:
            raise bad(f"'bad_words' holds {len(words)} words; send at most {MAX_BAD_WORDS}.", "bad_words")
        if llm.tokenizer is None:
            raise bad("'bad_words' need the model's tokenizer, and this model has none.", "bad_words")
        out["bad_words"] = tuple(words)
    spec, field = _structured(body, bad)
    if spec is not None:
        _compile(spec, field, llm, bad)
        out["structured_outputs"] = spec
    return out


def _logit_bias(v: Any, vocab: int, bad: Callable[..., Exception]) -> dict[int, float]:
    if not isinstance(v, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases in [-100, 100].", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(f"'logit_bias' holds {len(v)} entries; send at most {MAX_LOGIT_BIAS_ENTRIES}.", "logit_bias")
    out = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise bad(f"'logit_bias' keys must be token ids, got {str(k)[:40]!r}.", "logit_bias") from None
        if not 0 <= tid < vocab:
            raise bad(f"'logit_bias' token id {tid} is outside the vocabulary [0, {vocab}).", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad(f"'logit_bias[{tid}]' must be a number in [-100, 100], got {b!r}.", "logit_bias")
        out[tid] = float(b)
    return out


def _compile(spec: StructuredOutputsParams, field: str, llm: "LLM", bad: Callable[..., Exception]) -> None:
    import json

    text = spec.key()
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad(f"'{field}' is {len(text)} characters; send at most {MAX_GRAMMAR_CHARS}.", field)
    if llm.tokenizer is None:
        raise bad(f"'{field}' needs the model's tokenizer, and this model has none.", field)
    try:
        llm.processors.compiler.compile(spec)
    except GrammarError as e:
        raise bad(f"'{field}': {e}.", field) from None
    except (ValueError, RecursionError, json.JSONDecodeError) as e:
        raise bad(f"'{field}' could not be compiled: {e}.", field) from None


def controls_schema(vocab: int) -> dict[str, Any]:
    """These fields' JSON schemas for the served /openapi.json (server/openapi.py)."""
    def nullable(s: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return {"anyOf": [s, {"type": "null"}], **kw}

    schema_ = {"type": "object", "description": "a JSON schema"}
    fmt = {"oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": schema_,
                                                              "strict": nullable({"type": "boolean"})}}}}]}
    so = {"type": "object", "minProperties": 1, "maxProperties": 1, "properties": {
        "json": {"anyOf": [schema_, {"type": "string"}]}, "regex": {"type": "string"},
        "choice": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "grammar": {"type": "string", "description": "Lark, or GBNF / EBNF as llama.cpp writes it"},
        "json_object": {"const": True}}}
    return {
        "response_format": nullable(fmt, description="OpenAI's structured outputs"),
        "structured_outputs": nullable(so, description="vLLM's: exactly one of json, regex, choice, grammar, "
                                                       "json_object"),
        "presence_penalty": nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 2}),
        "logit_bias": nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                                "propertyNames": {"pattern": "^[0-9]+$"},
                                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                               description=f"token id (< {vocab}) -> bias"),
        "min_tokens": nullable({"type": "integer", "minimum": 0}),
        "bad_words": nullable({"type": "array", "maxItems": MAX_BAD_WORDS,
                               "items": {"type": "string", "minLength": 1}}),
    }
