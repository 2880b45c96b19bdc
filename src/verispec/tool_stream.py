"""Tool calls streamed: the Hermes `<tool_call>` blocks of verispec/tools.py read as the output text comes, turned
into OpenAI's chat deltas (content as it arrives, each call's header once its name is whole, then its arguments' JSON
text piece by piece). `parse_output` is the reference for the whole text; where a stream cannot agree with it, the
class says so.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from verispec.engine.stops import partial_stop_len
from verispec.tools import END, START

__all__ = ["ToolCallStream"]

JSON_SPACE = " \t\n\r"
JSON_CHARS = frozenset(JSON_SPACE + '{}[],:"-+.0123456789eEtrufalsn')  # every character JSON has outside strings
SCALAR = frozenset("-+.0123456789eEtrufalsn")  # those of numbers, true, false and null
PAIR = {"}": "{", "]": "["}


class ToolCallStream:
    """One streamed choice of a tools request: the output text in, as it comes, OpenAI's chat deltas out, as
    OpenAI's and vLLM's clients expect them: `feed(text_delta)` returns the deltas that text makes certain,
    `finish(finish_reason)` the last ones and the choice's finish_reason. Pure: no engine, no tensors.

      {"content": TEXT}
          text outside `<tool_call>` blocks, as it arrives. Held back only: a tail that could still become
          `<tool_call>`, and whitespace until content follows it (parse_output strips the content of an output
          with tool calls: trailing whitespace is dropped at the end, leading whitespace where a call came first;
          whitespace opening content that comes before any call has gone out by then, unlike parse_output's);
      {"tool_calls": [{"index": j, "id": "call_...", "type": "function", "function": {"name": NAME, "arguments": ""}}]}
          call j's header, as soon as its name string is complete;
      {"tool_calls": [{"index": j, "function": {"arguments": FRAGMENT}}]}
          the arguments' JSON text as the model writes it ("arguments" before "name" waits for the name). Joined,
          the fragments are that JSON text, which json.loads to what parse_output returns (parse_output
          re-serialises it). "parameters" stands in where there is no "arguments" (sent whole as the object
          closes), "{}" where there is neither, as in parse_output.

    Each block's JSON is read by a small scanner that knows strings and escapes, so the arguments end exactly where
    their value does (a `}` or "</tool_call>" inside a JSON string is string text). It checks what it can as it
    goes (characters JSON allows, brackets that match, no raw control characters in strings, keys and names that
    decode) and no more: it is a splitter, not a validator.

    Malformed blocks are dropped from the stream: a block that is not a JSON object, whose "name" is not a string,
    or that closes without one, sends nothing (arguments before the name were only held) and ends at its first
    `</tool_call>`, as parse_output ends it. parse_output drops such blocks too where the output has a
    tool call; where it has none it returns the whole text as content, which a stream cannot know in time. A
    fault that shows only after the header went out cannot be taken back: that call's arguments stop before it,
    and the block ends at its first `</tool_call>`. The text of a block unfinished at the end (finish_reason
    "length", or a stop string inside it) is dropped; a call whose header went out keeps what it sent. A second
    "name" or "arguments" in one object is skipped (json.loads keeps the last).

    The finish_reason is "tool_calls" where a call was sent and the model stopped on its own ("stop"), else the
    engine's (e.g. "length"), as for the non-streamed response.
    """

    def __init__(self) -> None:
        self._buf = ""  # text received and not yet consumed
        self._out: list[dict[str, Any]] = []  # the deltas of this feed
        self._calls = 0  # headers sent
        self._said = False  # some content other than whitespace sent
        self._space = ""  # whitespace after the last content sent, sent when more content follows
        self._state = "text"  # text; in a block: open, key, keystr, colon, value, val, next; skip (to the end tag)
        self._open()

    # ---- the interface ----
    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas that `text`, the output's next piece, makes certain."""
        self._buf += text
        while self._buf and self._step():
            pass
        self._flush()
        out, self._out = self._out, []
        return out

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas (content held back; an unfinished block's text is dropped) and the finish_reason."""
        if self._state == "text":
            self._content(self._buf)
        if not self._calls and self._space:  # no tool calls: the content is the text as it is
            self._push({"content": self._space})
        self._buf, self._space, self._state = "", "", "text"
        out, self._out = self._out, []
        return out, ("tool_calls" if self._calls and finish_reason == "stop" else finish_reason)

    # ---- deltas ----
    def _push(self, delta: dict[str, Any]) -> None:
        """Append a delta; content after content, and fragments after fragments of one call, merge."""
        last = self._out[-1] if self._out else None
        if last is not None and "content" in delta and "content" in last:
            last["content"] += delta["content"]
            return
        if last is not None and "tool_calls" in delta and "tool_calls" in last:
            a, b = last["tool_calls"][0], delta["tool_calls"][0]
            if "id" not in a and "id" not in b and a["index"] == b["index"]:
                a["function"]["arguments"] += b["function"]["arguments"]
                return
        self._out.append(delta)

    def _content(self, text: str) -> None:
        """Text outside blocks: sent but for its trailing whitespace (kept in `_space`), and its leading whitespace
        where a tool call came before any content."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if not body:
            return
        if not self._said and self._calls:
            body = body.lstrip()
        self._said = True
        self._push({"content": body})

    def _args(self, text: str) -> None:
        if text:
            self._push({"tool_calls": [{"index": self._calls - 1, "function": {"arguments": text}}]})

    def _flush(self) -> None:
        """Send the arguments text read so far."""
        if self._frag:
            self._args("".join(self._frag))
            self._frag = []

    # ---- the text ----
    def _step(self) -> bool:
        """Consume what of the buffer can be; True where the rest should be looked at again (a block began or
        ended)."""
        if self._state == "text":
            i = self._buf.find(START)
            if i < 0:
                cut = len(self._buf) - partial_stop_len(self._buf, (START,))
                self._content(self._buf[:cut])
                self._buf = self._buf[cut:]
                return False
            self._content(self._buf[:i])
            self._buf = self._buf[i + len(START):]
            self._open()
            self._state = "open"
            return True
        if self._state == "skip":
            text = self._raw + self._buf
            j = text.find(END)
            if j < 0:  # only a tail of it could still be part of the end tag
                self._raw, self._buf = text[-(len(END) - 1):], ""
                return False
            self._buf, self._raw, self._state = text[j + len(END):], "", "text"
            return True
        buf = self._buf
        for i, ch in enumerate(buf):
            end = self._char(ch)
            if end is not None:
                self._raw += buf[: i + 1]
                self._buf = buf[i + 1:]
                self._flush()
                if end == "close" and self._named:
                    if "arguments" not in self._held:
                        self._args(self._held.get("parameters") or "{}")
                    self._raw = ""  # a whole call: its end tag is the first after the object
                self._state = "skip"  # else the first after `<tool_call>`, as parse_output finds it
                return True
        self._raw += buf
        self._buf = ""
        return False

    # ---- a block's JSON object ----
    def _open(self) -> None:
        self._raw = ""  # the block's text read so far: where it is malformed, its end tag is searched here
        self._named = False  # the header went out
        self._tok = ""  # the key or name being read, as JSON text
        self._key: str | None = None  # the key whose value is being read
        self._to: str | None = None  # where that value goes: "name", "arguments", "parameters" or nowhere
        self._held: dict[str, str] = {}  # "arguments" / "parameters" text seen (held until the header)
        self._frag: list[str] = []  # arguments text read in this feed, to send
        self._kind, self._stack, self._instr, self._esc = "", "", False, False  # the value being read

    def _char(self, ch: str) -> str | None:
        """One character of the object: "close" where it closes it, "fault" where no JSON object goes on so."""
        state = self._state
        if state == "val":
            return self._value(ch)
        if state == "keystr":
            if ch < " ":
                return "fault"
            self._tok += ch
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                try:
                    self._key = json.loads(self._tok)
                except ValueError:
                    return "fault"
                self._state = "colon"
            return None
        if ch in JSON_SPACE or (state == "open" and ch.isspace()):  # parse_output takes any whitespace first
            return None
        if state == "open" and ch == "{":
            self._state = "key"
        elif state == "key" and ch == '"':
            self._state, self._tok, self._esc = "keystr", '"', False
        elif state == "colon" and ch == ":":
            self._state = "value"
        elif state == "next" and ch == ",":
            self._state = "key"
        elif state in ("key", "next") and ch == "}":
            return "close"
        elif state == "value":
            return self._begin(ch)
        else:
            return "fault"
        return None

    def _begin(self, ch: str) -> str | None:
        """A member's value starts with `ch`: its kind, and where its text goes."""
        kind = "str" if ch == '"' else "nest" if ch in "{[" else "scalar" if ch in SCALAR else ""
        if not kind:
            return "fault"
        if self._key == "name" and not self._named:
            if kind != "str":  # a name that is not a string: malformed
                return "fault"
            self._to, self._tok = "name", ""
        elif self._key in ("arguments", "parameters") and self._key not in self._held:
            self._to = self._key
            self._held[self._to] = ""
        else:
            self._to = None
        self._kind, self._stack, self._instr, self._esc = kind, "", False, False
        self._state = "val"
        return self._value(ch)

    def _value(self, ch: str) -> str | None:
        """One character of a member's value; its end moves on to the next member."""
        if self._kind == "scalar":
            if ch in SCALAR:
                self._keep(ch)
                return None
            if ch in JSON_SPACE or ch in ",}":  # the scalar ended before `ch`
                return self._end_value() or self._char(ch)
            return "fault"
        if self._instr:
            if ch < " ":
                return "fault"
            self._keep(ch)
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._instr = False
                if self._kind == "str":
                    return self._end_value()
            return None
        if ch not in JSON_CHARS or (ch in PAIR and (not self._stack or self._stack[-1] != PAIR[ch])):
            return "fault"
        self._keep(ch)
        if ch == '"':
            self._instr = True
        elif ch in "{[":
            self._stack += ch
        elif ch in PAIR:
            self._stack = self._stack[:-1]
            if not self._stack:
                return self._end_value()
        return None

    def _keep(self, ch: str) -> None:
        if self._to == "arguments" and self._named:
            self._frag.append(ch)
        elif self._to == "name":
            self._tok += ch
        elif self._to is not None:
            self._held[self._to] += ch

    def _end_value(self) -> str | None:
        """A value is whole: a name sends the header, and after it arguments that came before."""
        if self._to == "name":
            try:
                name = json.loads(self._tok)
            except ValueError:
                return "fault"
            self._named = True
            self._calls += 1
            self._push({"tool_calls": [{"index": self._calls - 1, "id": "call_" + uuid.uuid4().hex[:24],
                                        "type": "function", "function": {"name": name, "arguments": ""}}]})
            self._args(self._held.get("arguments", ""))
        self._state, self._to = "next", None
        return None
