"""What one request may send, checked before anything expensive runs: the body's size (413, counted as it
arrives), JSON nesting, lone UTF-16 surrogates (no tokenizer takes them) and a text prompt's UTF-8 bytes against
what the context could ever hold (refused without tokenising it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verispec.server.protocol import APIError, bad_request

if TYPE_CHECKING:
    from starlette.requests import Request

    from verispec.api import LLM

# 128k tokens as a JSON list of ids take about 8 bytes each (1 MiB), as escaped text at most ~6 per character
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
MAX_JSON_DEPTH = 64  # OpenAI bodies nest 4 levels (messages[i].content[j].text); 64 leaves room
# text can shrink before tokenising (NFKC / NFC normalisers, up to ~3x): a token covers at most this many times the
# bytes of the longest vocabulary entry
NORMALISER_SLACK = 4


def request_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes "
                         "(verispec serve --max-request-bytes). Send a shorter prompt.", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 as soon as it is known to exceed `limit` bytes: from Content-Length
    before reading anything, else while counting the chunks of a streamed (chunked) body."""
    declared = request.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        raise request_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
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
        else:
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
