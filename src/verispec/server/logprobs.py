"""OpenAI's `logprobs` on the wire: the request fields -> SamplingParams.logprobs, and per-token entries
(sampling/logprobs.py: the log_softmax of the target's raw logits, as vLLM returns by default) -> a choice's
`logprobs` object.

Completions: `"logprobs": N` (0..5) -> {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}.
Chat: `"logprobs": true` (+ `"top_logprobs": N`, 0..20) -> {content: [{token, logprob, bytes, top_logprobs:
[{token, logprob, bytes}]}], refusal: null}. A token's text is its own decoding (special tokens spelled out);
text_offset counts those texts' characters from the start of the completion, as vLLM does. -inf is sent as
-9999.0 (JSON has no infinity), as OpenAI and vLLM do.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from verispec.sampling.logprobs import TokenLogprobs

MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
FLOOR = -9999.0

TokenText = Callable[[int], str]
BadRequest = Callable[[str, str], Exception]  # (message, param) -> the 400 to raise (protocol.bad_request)


def _shown(v: Any) -> str:
    """A value quoted back in an error, cut short (a client may send a megabyte where a number belongs)."""
    text = json.dumps(v) if not isinstance(v, (list, dict)) or len(v) <= 16 else f"a list or object of {len(v)}"
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"


def _int_in(v: Any, key: str, hi: int, bad: BadRequest) -> int:
    ok = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    if not ok or not 0 <= int(v) <= hi:
        raise bad(f"'{key}' must be an integer from 0 to {hi}, got {_shown(v)}.", key)
    return int(v)


def parse_logprobs(body: dict, kind: str, bad: BadRequest) -> int | None:
    """The number of top logprobs per token the request asks for (0 = the sampled token only), or None."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "completion":
        if top is not None and not (_int_in(top, "top_logprobs", MAX_CHAT_TOP_LOGPROBS, bad) == 0):
            raise bad("'top_logprobs' is a chat field; on /v1/completions send 'logprobs': N (0 to "
                       f"{MAX_COMPLETION_LOGPROBS}) for the N most likely tokens.", "top_logprobs")
        return None if lp is None else _int_in(lp, "logprobs", MAX_COMPLETION_LOGPROBS, bad)
    if lp is not None and not isinstance(lp, bool):
        raise bad(f"'logprobs' must be true or false on /v1/chat/completions (with 'top_logprobs': 0 to "
                   f"{MAX_CHAT_TOP_LOGPROBS} for the most likely tokens), got {_shown(lp)}.", "logprobs")
    k = 0 if top is None else _int_in(top, "top_logprobs", MAX_CHAT_TOP_LOGPROBS, bad)
    if k > 0 and lp is not True:
        raise bad("'top_logprobs' needs \"logprobs\": true.", "top_logprobs")
    return k if lp else None


def token_text(tokenizer: Any) -> TokenText:
    """A token id's own text (special tokens spelled out); `token_id:N` without a tokenizer (vLLM's spelling)."""
    if tokenizer is None:
        return lambda t: f"token_id:{t}"
    return lambda t: tokenizer.decode([t], skip_special_tokens=False)


def _lp(v: float) -> float:
    return max(v, FLOOR)


class LogprobsFormatter:
    """One choice's `logprobs` objects, chunk after chunk (text_offset runs on across a stream's chunks)."""

    def __init__(self, kind: str, text: TokenText) -> None:
        self.kind, self.text, self.offset = kind, text, 0

    def format(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        return self._chat(entries) if self.kind == "chat" else self._completion(entries)

    def _chat(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        def item(tid: int, v: float) -> dict[str, Any]:
            s = self.text(tid)
            return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8", errors="replace"))}

        content = [{**item(e.token_id, e.logprob),
                    "top_logprobs": [item(t, v) for t, v in zip(e.top_ids, e.top_logprobs)]} for e in entries]
        return {"content": content, "refusal": None}

    def _completion(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        tokens, offsets, tops = [], [], []
        for e in entries:
            s = self.text(e.token_id)
            tokens.append(s)
            offsets.append(self.offset)
            self.offset += len(s)
            top = {self.text(t): _lp(v) for t, v in zip(e.top_ids, e.top_logprobs)}
            top.setdefault(s, _lp(e.logprob))  # the sampled token too, when it is not among the top N (as vLLM)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [_lp(e.logprob) for e in entries], "top_logprobs": tops,
                "text_offset": offsets}
