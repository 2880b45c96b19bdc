"""What one request may send, checked before anything expensive runs: its content type (415), the body's size
(413, counted as it arrives) and the time it takes to arrive (408), JSON nesting, lone UTF-16 surrogates (no
tokenizer takes them), a text prompt's UTF-8 bytes against what the context could ever hold (refused without
tokenising it) and, for long texts, its tokens counted piece by piece until they are known not to fit (refused
without tokenising it whole).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Iterator

from verispec.server.protocol import APIError, bad_request

if TYPE_CHECKING:
    from starlette.requests import Request

    from verispec.api import LLM

# 128k tokens as a JSON list of ids take about 8 bytes each (1 MiB), as escaped text at most ~6 per character
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # the default body limit's most (contexts of 8k tokens and more)
MIN_DEFAULT_REQUEST_BYTES = 1024 * 1024  # ... and its least
# the default body limit per context token: 20x what a token of escaped text takes (a 2,048-token context: 1 MiB, so
# the 4 MB bodies of issue 67 get their 413 from Content-Length before a byte is read)
BODY_BYTES_PER_TOKEN = 512
MAX_JSON_DEPTH = 64  # OpenAI bodies nest 4 levels (messages[i].content[j].text); 64 leaves room
# text can shrink before tokenising (NFKC / NFC normalisers, up to ~3x): a token covers at most this many times the
# bytes of the longest vocabulary entry
NORMALISER_SLACK = 4
DEFAULT_BODY_TIMEOUT = 30.0  # seconds from a request's headers to the end of its body (--timeout-body)
# text longer than this many bytes per context token (ordinary text takes about 4) has its tokens counted in
# pieces of COUNT_PIECE_CHARS characters, cut before a space, until the count shows it cannot fit
COUNT_ABOVE_BYTES_PER_TOKEN = 8
COUNT_PIECE_CHARS = 16384
CUT_SLACK = 8  # tokens a cut between two pieces may add to their count (a merge split in two, a prefix marker)


class ClientGone(Exception):
    """The client closed its connection before its request body had arrived: an ordinary end, not an error."""


def check_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (`application/json`, any parameters, charset UTF-8 if named); a
    request with no Content-Type is read as JSON, as OpenAI's and vLLM's servers do."""
    value = request.headers.get("content-type")
    if value is None:
        return
    kind, *params = (p.strip().lower() for p in value.split(";"))
    charset = next((p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")), "utf-8")
    if kind != "application/json" or charset not in ("utf-8", "utf8"):
        raise APIError(415, f"Unsupported Content-Type {value[:64]!r}: send the body as JSON with 'Content-Type: "
                            "application/json' (UTF-8).", param="content-type", code="unsupported_media_type")


def default_max_request_bytes(max_model_len: int) -> int:
    """The body limit when none is given: BODY_BYTES_PER_TOKEN per context token, within [1 MiB, 4 MiB]."""
    return min(DEFAULT_MAX_REQUEST_BYTES, max(MIN_DEFAULT_REQUEST_BYTES, max_model_len * BODY_BYTES_PER_TOKEN))


def request_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes "
                         "(verispec serve --max-request-bytes). Send a shorter prompt.", code="request_too_large")


def body_timed_out(timeout: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {timeout:g} s (verispec serve --timeout-body). "
                         "Send the whole body at once.", code="request_timeout", headers={"Connection": "close"})


async def read_body(request: Request, limit: int, timeout: float = DEFAULT_BODY_TIMEOUT,
                    stop: asyncio.Future | None = None, stopped: Any = None) -> bytes:
    """The request body, refused with a 413 as soon as it is known to exceed `limit` bytes (from Content-Length
    before reading anything, else while counting the chunks), with a 408 when it has not all arrived `timeout`
    seconds after the headers, with `stopped()` (an APIError) once `stop` is done (the server shuts down), and
    ClientGone when the client hangs up first."""
    declared = request.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        raise request_too_large(limit)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    chunks, size, more = [], 0, True
    while more:
        get = asyncio.ensure_future(request.receive())
        done, _ = await asyncio.wait([get] if stop is None else [get, stop], timeout=max(0.0, deadline - loop.time()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            get.cancel()
            raise stopped() if stop is not None and stop in done else body_timed_out(timeout)
        message = get.result()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            raise request_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _check_text(s: str, where: str | None) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"'{where or 'the body'}' holds a lone UTF-16 surrogate ({ascii(s[e.start])[1:-1]}) at "
                          f"character {e.start}: send valid Unicode text (a surrogate must be paired, e.g. "
                          "\\ud83d\\ude00).", where) from None


_SCALARS = frozenset({int, float, bool, type(None)})  # what json.loads gives besides str, list and dict


def check_json(body: Any) -> None:
    """400 for a value nested deeper than MAX_JSON_DEPTH, or a string (value or key) holding a lone UTF-16 surrogate,
    naming where (e.g. `messages[0].content`). Iterative: it never recurses however deep the body nests."""
    todo: list[tuple[Any, str, int]] = [(body, "", 0)]
    while todo:
        value, where, depth = todo.pop()
        if isinstance(value, str):
            _check_text(value, where or None)
            continue
        if depth >= MAX_JSON_DEPTH:
            raise bad_request(f"'{where}' is nested more than {MAX_JSON_DEPTH} levels deep: OpenAI request bodies "
                              "nest a few levels at most.", where or None)
        if isinstance(value, dict):
            for key, v in value.items():
                _check_text(key, where or None)
                if isinstance(v, (str, list, dict)):
                    todo.append((v, f"{where}.{key}" if where else key, depth + 1))
        elif not _SCALARS.issuperset(map(type, value)):  # (a list of numbers is skipped at C speed)
            todo.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)
                        if isinstance(v, (str, list, dict)))


def prompt_byte_limit(llm: LLM) -> int | None:
    """The most UTF-8 bytes of prompt text that could fit in the context: max_model_len tokens, each covering at
    most NORMALISER_SLACK x the bytes of the longest vocabulary entry. None without a tokenizer (ids only)."""
    if llm.tokenizer is None:
        return None
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in llm.tokenizer.get_vocab()), default=1)
    return llm.max_model_len * NORMALISER_SLACK * max(longest, 1)


def _text_bytes(value: Any) -> int:
    """UTF-8 bytes of a text prompt (a string or a list of one) or chat content (a string or text parts)."""
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, list):
        return sum(_text_bytes(v.get("text") if isinstance(v, dict) else v) for v in value
                   if isinstance(v, (str, dict)))
    return 0


def check_prompt_bytes(body: dict[str, Any], limit: int | None) -> None:
    """400 (naming `prompt` or `messages`) for prompt text longer in bytes than the context could ever hold, before
    any tokenising. Run after `check_json` (the text is valid Unicode)."""
    if limit is None:
        return
    prompt, msgs = body.get("prompt"), body.get("messages")
    if isinstance(prompt, (str, list)):
        key, size = "prompt", _text_bytes(prompt)
    elif isinstance(msgs, list):
        key, size = "messages", sum(_text_bytes(m.get("content")) for m in msgs if isinstance(m, dict))
    else:
        return
    if size > limit:
        raise bad_request(f"'{key}' holds {size} bytes of text: more than this model's context could ever hold "
                          f"(at most {limit} bytes for its tokens). Shorten the prompt.", key,
                          "context_length_exceeded")


def _pieces(text: str) -> Iterator[str]:
    """`text` in pieces of about COUNT_PIECE_CHARS characters, each cut before a space where there is one."""
    start = 0
    while start < len(text):
        end = min(len(text), start + COUNT_PIECE_CHARS)
        if end < len(text):
            space = text.rfind(" ", start + COUNT_PIECE_CHARS // 2, end)
            end = space if space > start else end
        yield text[start:end]
        start = end


def _texts(body: dict[str, Any]) -> tuple[str, list[str]]:
    """The prompt text(s) of a body and the field they are in ("prompt" or "messages")."""
    prompt, msgs = body.get("prompt"), body.get("messages")
    if isinstance(prompt, str):
        return "prompt", [prompt]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return "prompt", [prompt[0]]
    if not isinstance(msgs, list):
        return "prompt", []
    out: list[str] = []
    for m in msgs:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "messages", out


def check_prompt_tokens(body: dict[str, Any], llm: LLM) -> None:
    """400 (context_length_exceeded) for prompt text that holds at least max_model_len tokens, found by
    tokenising it in pieces and stopping as soon as their count (less CUT_SLACK per cut) reaches the context: a
    1.3 MB prompt for a 2,048-token context costs one piece's tokenising, not the whole text's. Only texts of more
    than COUNT_ABOVE_BYTES_PER_TOKEN bytes per context token are counted (shorter ones are tokenised as usual)."""
    if llm.tokenizer is None:
        return
    key, texts = _texts(body)
    context = llm.max_model_len
    if sum(len(t.encode("utf-8")) for t in texts) <= context * COUNT_ABOVE_BYTES_PER_TOKEN:
        return
    counted, cuts = 0, -1
    for text in texts:
        for piece in _pieces(text):
            counted += len(llm.tokenizer(piece, add_special_tokens=False)["input_ids"])
            cuts += 1
            if counted - CUT_SLACK * max(cuts, 0) >= context:
                raise bad_request(f"'{key}' holds more than {context - 1} tokens (counted on its first pieces of "
                                  f"text), but this model's context holds {context} (prompt + completion). Shorten "
                                  "the prompt.", key, "context_length_exceeded")
