"""Tool calling, shared by the Python API (`LLM.chat(..., tools=...)`) and the server (server/tools.py, the HTTP
side: the request body's fields and their 400s): OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, in the
Hermes format of Qwen2.5 / Qwen3 templates (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`).

  check    - `tool_spec` / `check_tools`: the tools and the choice validated into a ToolSpec (None for no tools or
             tool_choice "none"); each error names its argument, raised as the caller's exception;
  prompt   - the chat template renders the tools where it takes them (`tools=`); a template that ignores them (the
             default model's) gets Hermes' instructions and the tools' signatures as a system message;
  grammar  - `required` or a named function: the output is constrained (sampling/grammar.py) to one tool call, or
             one or more with parallel_tool_calls, whose arguments follow the function's parameter schema, so
             `required` never returns plain text; `auto` leaves the model free; `none` sends no tools;
  parse    - the output's `<tool_call>` blocks become OpenAI `tool_calls` (arguments as JSON text), the rest the
             message content;
  stream   - ToolCallStream turns the text as it comes into OpenAI's deltas: content as it arrives, each call's name
             once it is whole, then its arguments' JSON text piece by piece.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from verispec.engine.stops import partial_stop_len
from verispec.sampling import SamplingParams
from verispec.sampling.grammar import JSON_OPTIONS, StructuredOutputsParams

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
START, END = "<tool_call>", "</tool_call>"
HERMES = ("You may call functions. Their signatures: <tools>{tools}</tools> To call one, answer with\n"
          "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-object>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[dict[str, Any], ...]  # OpenAI's {"type": "function", "function": {name, description, parameters}}
    choice: str  # "auto" | "required" | a function's name
    parallel: bool = True

    def functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]


def check_tools(tools: Any, choice: Any, par: Any, bad: Callable[..., Exception]) -> ToolSpec | None:
    """The tools and tool choice as a ToolSpec (None where there are no tools or tool_choice is "none"); each error
    is `bad(message, argument)`, its message naming the argument."""
    if not isinstance(par, bool):
        raise bad("'parallel_tool_calls' must be true or false.", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad("'tool_choice' needs 'tools'.", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad(f"'tools' must be a list of at most {MAX_TOOLS} function tools.", "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise bad(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}.",
                      f"tools[{i}]")
        if not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
            raise bad(f"'tools[{i}].function.name' must be 1-64 letters, digits, _ or -.", f"tools[{i}].function.name")
        if not isinstance(f.get("parameters", {}), dict):
            raise bad(f"'tools[{i}].function.parameters' must be a JSON schema object.",
                      f"tools[{i}].function.parameters")
        names.append(f["name"])
    if choice is None or choice in ("auto", "required"):
        choice = choice or "auto"
    elif choice == "none":
        return None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        choice = choice["function"].get("name")
        if choice not in names:
            raise bad(f"'tool_choice' names {str(choice)[:64]!r}, which is not among 'tools'.", "tool_choice")
    else:
        raise bad("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                  "{\"name\": ...}}.", "tool_choice")
    return ToolSpec(tuple(tools), choice, par)


def value_error(message: str, _argument: str) -> ValueError:
    """The Python API's error for a bad argument (its message names it)."""
    return ValueError(message)


def tool_spec(tools: Any, tool_choice: Any = "auto", parallel_tool_calls: Any = True) -> ToolSpec | None:
    """The Python API's tools (`LLM.chat`): as check_tools, errors as ValueError naming the argument."""
    return check_tools(tools, tool_choice, parallel_tool_calls, value_error)


def render(llm: Any, messages: list[dict[str, str]], spec: ToolSpec) -> str:
    """The prompt: the template with `tools=` where it renders them, else Hermes' system message first."""
    funcs = spec.tools
    try:
        text = llm.tokenizer.apply_chat_template(messages, tools=list(funcs), tokenize=False,
                                                 add_generation_prompt=True)
        if all(f["function"]["name"] in text for f in funcs):
            return text
    except Exception:  # noqa: BLE001 - a template without tool support: fall back to the system message
        pass
    system = HERMES.format(tools=json.dumps(spec.functions(), separators=(",", ":")))
    if messages and messages[0]["role"] == "system":
        messages = [{"role": "system", "content": messages[0]["content"] + "\n\n" + system}] + messages[1:]
    else:
        messages = [{"role": "system", "content": system}] + messages
    return llm.apply_chat_template(messages)


def grammar(spec: ToolSpec) -> StructuredOutputsParams | None:
    """`required` / named: one tool call (or several with parallel_tool_calls) of the allowed functions, their
    arguments following each function's parameter schema; None for `auto`."""
    if spec.choice == "auto":
        return None
    funcs = [f for f in spec.functions() if spec.choice == "required" or f["name"] == spec.choice]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]},
                             "arguments": f.get("parameters") or {"type": "object"}}} for f in funcs]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": JSON_OPTIONS}  # fixed separators, no free whitespace (sampling/grammar.py)
    start = 'start: call ("\\n" call)*' if spec.parallel else "start: call"
    return StructuredOutputsParams(grammar=f'{start}\ncall: "<tool_call>\\n" %json {json.dumps(schema)} '
                                           '"\\n</tool_call>"')


def constrain(params: Sequence[SamplingParams], spec: ToolSpec, compile: Callable[[StructuredOutputsParams], Any],
              bad: Callable[..., Exception]) -> list[SamplingParams]:
    """Each request's params with the tool-call grammar where the choice is `required` or a named function (as
    they are for `auto`), the grammar compiled once first; errors `bad(message, argument)`: other structured
    outputs beside it, or a function's parameters that do not compile."""
    g = grammar(spec)
    if g is None:
        return list(params)
    if any(p.structured_outputs is not None for p in params):
        raise bad("'tool_choice' required or a named function cannot go with 'response_format' or "
                  "'structured_outputs'.", "tool_choice")
    try:
        compile(g)
    except ValueError as e:
        raise bad(f"'tools': a function's parameters could not be compiled: {e}", "tools") from None
    return [replace(p, structured_outputs=g) for p in params]


def _is_call(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("name"), str)


def _blocks(text: str) -> list[tuple[int, int, Any]]:
    """(start, end, call object or None) of each `<tool_call>` block in order. A block whose text is one JSON
    object with a string name followed by the end tag ends there, so a `</tool_call>` inside a JSON string is string
    text (as ToolCallStream reads it); any other block ends at its first end tag, its value None (malformed, as the
    stream drops it); an unclosed one is no block."""
    out, pos, dec = [], 0, json.JSONDecoder()
    while (i := text.find(START, pos)) >= 0:
        j = i + len(START)
        while j < len(text) and text[j].isspace():
            j += 1
        try:
            value, k = dec.raw_decode(text, j)
        except ValueError:
            value, k = None, j
        while k < len(text) and text[k].isspace():
            k += 1
        if _is_call(value) and text.startswith(END, k):
            end = k + len(END)
        else:
            e = text.find(END, i)
            if e < 0:
                break
            value, end = None, e + len(END)
        out.append((i, end, value))
        pos = end
    return out


def parse_output(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output: each well-formed `<tool_call>` block (a JSON object with a
    string name) becomes an OpenAI tool call; the text outside the blocks is the content (None when empty)."""
    calls, blocks = [], _blocks(text)
    for _, _, obj in blocks:
        if obj is None:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    if not calls:
        return text, []
    kept, pos = [], 0
    for start, end, _ in blocks:
        kept.append(text[pos:start])
        pos = end
    content = ("".join(kept) + text[pos:]).strip()
    return content or None, calls


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
