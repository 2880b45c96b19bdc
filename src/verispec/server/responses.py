"""The OpenAI wire format's responses: whole bodies and SSE chunks of completions and chat completions (tool calls
streamed as they are parsed), usage, and the incremental text a stream sends.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from verispec.engine.stops import partial_stop_len
from verispec.server import tools as tools_
from verispec.tool_stream import ToolCallStream
from verispec.server.protocol import ParsedRequest


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class ResponseBuilder:
    """Builds one request's response body or its stream of SSE chunks, in OpenAI's shapes."""

    req: ParsedRequest
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or new_id(self.req.kind)
        self.created = self.created or int(time.time())

    def _choice(self, text: str, token_ids: list[int], finish: str | None, delta: bool,
                stop_reason: str | None = None, index: int = 0, logprobs: dict | None = None) -> dict[str, Any]:
        if self.req.kind == "chat" and self.req.tools is not None and not delta:  # streamed: tool_chunks
            val, finish = tools_.message(text, finish)
            choice = {"index": index, "message": val, "logprobs": logprobs, "finish_reason": finish}
        elif self.req.kind == "chat":
            key, val = ("delta", {"content": text}) if delta else ("message", {"role": "assistant", "content": text})
            choice = {"index": index, key: val, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        choice["stop_reason"] = stop_reason  # vLLM's: the stop string that ended the text, else null
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def response(self, text: str, token_ids: list[int], finish: str | None,
                 stop_reason: str | None = None) -> dict[str, Any]:
        obj = "chat.completion" if self.req.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [self._choice(text, token_ids, finish, False, stop_reason)],
                "usage": usage(len(self.req.prompt_ids), len(token_ids))}

    def choice(self, text: str, token_ids: list[int], finish: str | None, stop_reason: str | None = None,
               index: int = 0, logprobs: dict | None = None) -> dict[str, Any]:
        """One finished choice of a whole (non-streamed) response."""
        return self._choice(text, token_ids, finish, False, stop_reason, index, logprobs)

    def full_response(self, choices: list[dict[str, Any]], completion_tokens: int) -> dict[str, Any]:
        """The response with all `n` choices; usage counts the completion tokens of all of them."""
        obj = "chat.completion" if self.req.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "usage": usage(len(self.req.prompt_ids), completion_tokens)}

    def _chunk(self, choices: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> str:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        body: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                                "choices": choices}
        if self.req.include_usage:
            body["usage"] = usage_
        return sse(body)

    def first_chunk(self, index: int = 0) -> str | None:
        """Chat streams open with the assistant role (one chunk per choice), as OpenAI's do."""
        if self.req.kind != "chat":
            return None
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._chunk([choice])

    def delta_chunk(self, text: str, token_ids: list[int], finish: str | None, stop_reason: str | None = None,
                    index: int = 0, logprobs: dict | None = None) -> str:
        if self.req.kind == "chat" and self.req.tools is not None:
            return self.tool_chunks(text, token_ids, finish, stop_reason, index, logprobs)
        choice = self._choice(text, token_ids, finish, True, stop_reason, index, logprobs)
        if self.req.kind == "chat" and finish is not None and not text:
            choice["delta"] = {}
        return self._chunk([choice])

    def tool_chunks(self, text: str, token_ids: list[int], finish: str | None, stop_reason: str | None = None,
                    index: int = 0, logprobs: dict | None = None) -> str:
        """A tools request's chunks for the next piece of text (tool_stream.ToolCallStream, one per choice): content as
        it comes, each call's header once its name is whole, then its arguments' JSON text; one chunk per delta.
        This step's token ids and logprobs ride on its first chunk (an empty delta where the text was held back,
        so that none are lost); the finish_reason comes alone in a last chunk with an empty delta."""
        streams = self.__dict__.setdefault("_tool_streams", {})
        parser = streams.setdefault(index, ToolCallStream())
        deltas = parser.feed(text)
        if finish is not None:
            tail, finish = parser.finish(finish)
            deltas += tail
            del streams[index]
        if not deltas and ((self.req.return_token_ids and token_ids) or logprobs):
            deltas = [{}]
        chunks = []
        for k, delta in enumerate(deltas):
            choice = {"index": index, "delta": delta, "logprobs": logprobs if k == 0 else None,
                      "finish_reason": None, "stop_reason": None}
            if self.req.return_token_ids:
                choice["token_ids"] = token_ids if k == 0 else []
            chunks.append(self._chunk([choice]))
        if finish is not None:
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish,
                      "stop_reason": stop_reason}
            if self.req.return_token_ids:
                choice["token_ids"] = [] if deltas else token_ids
            chunks.append(self._chunk([choice]))
        return "".join(chunks)

    def usage_chunk(self, completion_tokens: int) -> str | None:
        if not self.req.include_usage:
            return None
        return self._chunk([], usage(len(self.req.prompt_ids), completion_tokens))


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class IncrementalText:
    """Text of a growing token list, emitted as suffixes; text ending in an incomplete UTF-8 sequence waits, and so
    does a tail that could still become one of `hold` (stop strings cut from the output): it is never sent early."""

    def __init__(self, decode: Callable[[list[int]], str], hold: Sequence[str] = ()) -> None:
        self.decode, self.sent, self.hold = decode, 0, tuple(hold)

    def update(self, ids: list[int], final: bool, text: str | None = None) -> str:
        """The new text of `ids` (or the final `text` given, e.g. the output cut at a stop string)."""
        text = self.decode(ids) if text is None else text
        if not final and text.endswith("\ufffd"):
            return ""
        if not final:
            text = text[: len(text) - partial_stop_len(text, self.hold)]
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta
