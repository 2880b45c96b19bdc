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
  stream   - verispec/tool_stream.py's ToolCallStream: the same format read as the text comes, into OpenAI's deltas.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

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
