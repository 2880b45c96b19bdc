"""The OpenAI wire format's requests: validate bodies into (prompt ids, SamplingParams), and errors (responses:
server/responses.py).

Validation is written out by hand rather than through pydantic models so that every rejection is an HTTP 400 with
OpenAI's error body, naming the offending field (`param`) and saying what to send instead.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from verispec.sampling import SamplingParams
from verispec.server.bounds import (MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, check_bookkeeping,
                                    echo_name, shown)
from verispec.server.logprobs import parse_logprobs
from verispec.server.structured import KEYS as STRUCTURED_KEYS
from verispec.server.structured import parse_controls
from verispec import tools as tool_calling
from verispec.server import tools as tools_

if TYPE_CHECKING:
    from verispec.api import LLM

# Below this temperature sampling is numerically the argmax anyway (and logits / T would overflow): treat as greedy.
GREEDY_TEMPERATURE = 1e-5
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16  # choices per request (`n`)


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- the served model ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServedModel:
    """The model id shown by /v1/models, and every name a request's `model` field may use for it."""

    id: str
    aliases: frozenset[str] = frozenset()
    max_model_len: int = 0
    created: int = 0

    def check(self, name: Any) -> None:
        if name is None:  # optional here (OpenAI requires it; vLLM does not)
            return
        if not isinstance(name, str):
            raise bad_request(f"'model' must be a string, e.g. {self.id!r}", "model")
        if name != self.id and name.lower() not in self.aliases:
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.id}` "
                                "(see GET /v1/models).", param="model", code="model_not_found")

    def card(self) -> dict[str, Any]:
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "verispec",
                "max_model_len": self.max_model_len}


# ---- JSON and field helpers ----------------------------------------------------------------------------------
def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 unless it is UTF-8 (json.loads alone would also take UTF-16 and UTF-32)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"The request body is not UTF-8 text (byte {e.start} cannot be decoded): send JSON "
                          "encoded as UTF-8.") from None
    try:
        body = json.loads(text, parse_constant=_no_constants)
    except ValueError as e:
        raise bad_request(f"The request body is not valid JSON ({e}). Send a JSON object with "
                          "Content-Type: application/json.") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply to parse: send a JSON object whose arrays and "
                          "objects nest a few levels at most.") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got a JSON {type(body).__name__}.")
    return body


def _is_int(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def _int(body: dict, key: str, default: int | None, lo: int | None = None, hi: int | None = None,
         what: str = "") -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise bad_request(f"'{key}' must be an integer{what}, got {shown(v)}.", key)
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(f"'{key}' must be an integer{what}, got {v}.", key)
    return v


def _num(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"'{key}' must be a number, got {shown(v)}.", key)
    return float(v)


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be true or false, got {shown(v)}.", key)
    return v


def _token_ids(v: Any, key: str, vocab: int, most: int | None = None, why: str = "") -> list[int]:
    """`v` as token ids in [0, vocab); with `most`, 400 for more than that many before looking at any."""
    if not isinstance(v, list):
        raise bad_request(f"'{key}' must be a list of integer token ids.", key)
    if most is not None and len(v) > most:
        raise bad_request(f"'{key}' holds {len(v)} token ids; send at most {most}{why}.", key)
    if not all(_is_int(t) for t in v):
        raise bad_request(f"'{key}' must be a list of integer token ids.", key)
    ids = [int(t) for t in v]
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"'{key}' holds token ids {bad[:5]} outside the vocabulary [0, {vocab}).", key)
    return ids


# Fields accepted only at their neutral value: anything else is a feature verispec does not implement.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
}
_HINTS: dict[str, str] = {}  # per neutral-only field: what to do instead
_IGNORED = {"user", "metadata", "store", "service_tier"}  # bookkeeping fields with no effect on the output
_SAMPLING_KEYS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
                  "stop", "include_stop_str_in_output",
                  "n", "stream", "stream_options", "return_token_ids", "top_logprobs", *_NEUTRAL, *_IGNORED,
                  *STRUCTURED_KEYS}
COMPLETION_KEYS = _SAMPLING_KEYS | {"prompt", "logprobs"}
CHAT_KEYS = _SAMPLING_KEYS | {"messages", "max_completion_tokens", "logprobs", "response_format",
                              "split_special_tokens"}


def _same(v: Any, neutral: Any) -> bool:
    if neutral is None or isinstance(neutral, bool) or isinstance(v, bool):
        return v is neutral
    return v == neutral  # 0 == 0.0; values of other types never compare equal


def _check_keys(body: dict, allowed: set[str]) -> None:
    unknown = [k for k in body if k not in allowed]
    if unknown:
        names = ", ".join(echo_name(k) for k in sorted(unknown)[:5]) + (f" and {len(unknown) - 5} more"
                                                                    if len(unknown) > 5 else "")
        raise bad_request(f"Unrecognized request argument(s): {names}. Supported: "
                          f"{', '.join(sorted(allowed - _IGNORED))}.", echo_name(min(unknown)))
    check_bookkeeping(body, bad_request)
    for key, neutral in _NEUTRAL.items():
        if key in body and not any(_same(body[key], n) for n in neutral):
            hint = _HINTS.get(key, f"remove '{key}' or send its default")
            raise bad_request(f"'{key}' = {shown(body[key])} is not supported by verispec: {hint}.", key)


# ---- requests ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    n: int = 1  # choices: the server runs n engine requests (seeds seed + i)
    tools: Any = None  # a chat request's tools (server/tools.py): its output is parsed into tool_calls


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_request("'stream_options' is only allowed with \"stream\": true.", "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise bad_request("'stream_options' must be an object like {\"include_usage\": true}.", "stream_options")
    return stream, _bool(opts, "include_usage", False)


def _stop(body: dict) -> tuple[str, ...]:
    """OpenAI's `stop`: null, a string or a list of up to 4 strings (of MAX_STOP_CHARS each); "" and [] mean
    none."""
    v = body.get("stop")
    if v is None or v == "":
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad_request(f"'stop' must be a non-empty string or a list of non-empty strings, got {shown(v)}.",
                          "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds {len(items)} strings; send at most {MAX_STOP_STRINGS}.", "stop")
    longest = max(items, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise bad_request(f"'stop' holds a string of {len(longest)} characters; each may have at most "
                          f"{MAX_STOP_CHARS}.", "stop")
    return tuple(items)


def _too_long(prompt_len: int, max_model_len: int, key: str) -> APIError:
    return bad_request(f"The prompt has {prompt_len} tokens, but this model's context holds {max_model_len} "
                       f"(prompt + completion). Shorten the prompt to under {max_model_len} tokens.", key,
                       "context_length_exceeded")


def _params(body: dict, prompt_len: int, max_model_len: int, vocab: int, max_key: str,
            default_max: int | None, prompt_key: str) -> SamplingParams:
    if prompt_len >= max_model_len:
        raise _too_long(prompt_len, max_model_len, prompt_key)
    room = max_model_len - prompt_len
    for other in {"max_tokens", "max_completion_tokens"} - {max_key}:  # the one not used must be valid too
        _int(body, other, None, lo=1, what=" >= 1")
    max_tokens = _int(body, max_key, default_max, lo=1, what=" >= 1")
    if max_tokens is None:
        max_tokens = room
    if max_tokens > room:
        raise bad_request(f"This model's context holds {max_model_len} tokens, but you requested "
                          f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} for the completion). "
                          f"Lower '{max_key}' to at most {room}, or shorten the prompt.", max_key,
                          "context_length_exceeded")
    temperature = _num(body, "temperature", 1.0)
    if temperature < 0:
        raise bad_request(f"'temperature' must be >= 0 (0 = greedy), got {temperature}.", "temperature")
    top_p = _num(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}.", "top_p")
    top_k = _int(body, "top_k", 0, lo=-1, what=" >= 1, or 0 / -1 for no limit")
    seed = _int(body, "seed", None, lo=-(2**63), hi=2**64 - 1, what=" in [-2^63, 2^64)")
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else _token_ids(stop_ids, "stop_token_ids", vocab, MAX_STOP_TOKEN_IDS,
                                                        " (the ids that end the output)")
    try:
        return SamplingParams(temperature=0.0 if temperature < GREEDY_TEMPERATURE else temperature, top_p=top_p,
                              top_k=top_k, max_tokens=max_tokens, seed=seed,
                              ignore_eos=_bool(body, "ignore_eos", False), stop_token_ids=tuple(stop_ids),
                              stop=_stop(body),
                              include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False))
    except ValueError as e:
        raise bad_request(str(e)) from None


def _finish(kind: str, body: dict, llm: LLM, ids: list[int], max_key: str, default_max: int | None) -> ParsedRequest:
    prompt_key = "messages" if kind == "chat" else "prompt"
    if not ids:
        raise bad_request("The prompt is empty: it encodes to no tokens. Send at least one token.", prompt_key)
    params = _params(body, len(ids), llm.max_model_len, llm.model.cfg.vocab_size, max_key, default_max, prompt_key)
    if params.stop and llm.tokenizer is None:
        raise bad_request("'stop' strings need the model's tokenizer, and this model has none: use 'stop_token_ids'.",
                          "stop")
    n = _int(body, "n", 1, lo=1, hi=MAX_N, what=f" from 1 to {MAX_N} (choices per request)")
    top = parse_logprobs(body, kind, bad_request)
    params = params if top is None else replace(params, logprobs=top)
    controls = parse_controls(body, llm, bad_request)  # structured outputs and sampling controls (server/structured.py)
    if controls:
        try:
            params = replace(params, **controls)
        except ValueError as e:
            raise bad_request(str(e)) from None
    stream, include_usage = _stream_flags(body)
    return ParsedRequest(kind, ids, params, stream, include_usage, _bool(body, "return_token_ids", False), n)


def _prompt_ids(prompt: Any, llm: LLM) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if llm.tokenizer is None:
            raise bad_request("This model has no tokenizer: send 'prompt' as a list of token ids.", "prompt")
        return list(llm.tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, list) and prompt and _is_int(prompt[0]):
        if len(prompt) >= llm.max_model_len:  # refused before looking at each id
            raise _too_long(len(prompt), llm.max_model_len, "prompt")
        return _token_ids(prompt, "prompt", llm.model.cfg.vocab_size)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"Batched prompts ({len(prompt)}) are not supported: send one prompt per request.", "prompt")
    raise bad_request("'prompt' must be a string, a list of one string, or a list of token ids.", "prompt")


def parse_completion(body: dict, llm: LLM, served: ServedModel) -> ParsedRequest:
    _check_keys(body, COMPLETION_KEYS)
    served.check(body.get("model"))
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("Missing required field 'prompt' (a string or a list of token ids).", "prompt")
    return _finish("completion", body, llm, _prompt_ids(body["prompt"], llm), "max_tokens", 16)


def _message(m: Any, i: int) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"'{where}' must be an object like {{\"role\": \"user\", \"content\": \"Hi\"}}.", where)
    role, content = m.get("role"), m.get("content")
    if role not in CHAT_ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {shown(role)}.",
                          f"{where}.role")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise bad_request(f"'{where}.content' parts must all be {{\"type\": \"text\", \"text\": ...}}: "
                              "verispec serves text-only models.", f"{where}.content")
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_request(f"'{where}.content' must be a string or a list of text parts.", f"{where}.content")
    return {"role": role, "content": content}


def parse_chat(body: dict, llm: LLM, served: ServedModel) -> ParsedRequest:
    _check_keys({k: v for k, v in body.items() if k not in tools_.KEYS}, CHAT_KEYS)
    spec = tools_.parse_tools(body, bad_request)
    served.check(body.get("model"))
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("Missing required field 'messages' (a list of {\"role\", \"content\"} objects).", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list of {\"role\", \"content\"} objects.", "messages")
    if len(msgs) >= llm.max_model_len:  # every message takes at least one token of the template
        raise bad_request(f"'messages' holds {len(msgs)} messages, but this model's context holds "
                          f"{llm.max_model_len} tokens and each message takes at least one.", "messages",
                          "context_length_exceeded")
    messages = [_message(m, i) for i, m in enumerate(msgs)]
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    try:
        text = llm.apply_chat_template(messages) if spec is None else tool_calling.render(llm, messages, spec)
    except ValueError as e:
        raise bad_request(f"{e}.", "messages") from None
    except Exception as e:  # a template may raise on unusual role orders
        raise bad_request(f"The chat template rejected these messages: {e}", "messages") from None
    if _bool(body, "split_special_tokens", False):
        ids = _chat_ids_split(llm, messages)
    else:  # as vLLM: the template holds the special tokens, and so may the messages' text
        ids = list(llm.tokenizer(text, add_special_tokens=False)["input_ids"])
    parsed = _finish("chat", body, llm, ids, max_key, None)
    return parsed if spec is None else _with_tools(parsed, spec, llm)


def _with_tools(parsed: ParsedRequest, spec: Any, llm: LLM) -> ParsedRequest:
    """A tools request: `required` / a named function constrain the output to tool calls (server/tools.py)."""
    [params] = tool_calling.constrain([parsed.params], spec, llm.processors.compiler.compile, bad_request)
    return replace(parsed, params=params, tools=spec)


_MARK = re.compile("\ue000(\\d+)\ue001")  # a message's place in the rendered template (private-use characters)


def _chat_ids_split(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    """The chat prompt's ids with special tokens typed in the messages' text tokenised as plain text (`<|im_end|>`
    in a user message stays characters, not a role boundary): the template is rendered with a marker in place of
    each message's content, its own text tokenised as usual and each content with HF's split_special_tokens."""
    marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
    rendered = llm.apply_chat_template(marked)
    ids: list[int] = []
    pieces = _MARK.split(rendered)  # template text, message index, template text, ...
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            ids += llm.tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
        else:
            content = messages[int(piece)]["content"]
            ids += llm.tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids
