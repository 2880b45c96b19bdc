"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, in the
Hermes format of Qwen2.5 / Qwen3 templates (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`).

  prompt   - the chat template renders the tools where it takes them (`tools=`); a template that ignores them (the
             default model's) gets Hermes' instructions and the tools' signatures as a system message;
  grammar  - `required` or a named function: the output is constrained (sampling/grammar.py) to one tool call, or
             one or more with parallel_tool_calls, whose arguments follow the function's parameter schema, so
             `required` never returns plain text; `auto` leaves the model free; `none` sends no tools;
  parse    - the output's `<tool_call>` blocks become OpenAI `tool_calls` (arguments as JSON text), the rest the
             message content; finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from verispec.sampling.grammar import JSON_OPTIONS, StructuredOutputsParams

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
HERMES = ("You may call functions. Their signatures: <tools>{tools}</tools> To call one, answer with\n"
          "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-object>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[dict[str, Any], ...]  # OpenAI's {"type": "function", "function": {name, description, parameters}}
    choice: str  # "auto" | "required" | a function's name
    parallel: bool = True

    def functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]


def parse_tools(body: dict, bad: Callable[..., Exception]) -> ToolSpec | None:
    """The request's tools (None where there are none or tool_choice is "none"); 400s name the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    par = body.get("parallel_tool_calls", True)
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


def parse_output(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output: each well-formed `<tool_call>` block (a JSON object with a
    string name) becomes an OpenAI tool call; the text outside them is the content (None when empty)."""
    calls = []
    for m in CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    if not calls:
        return text, []
    content = CALL.sub("", text).strip()
    return content or None, calls


def message(text: str, finish: str | None, delta: bool) -> tuple[dict[str, Any], str | None]:
    """A chat choice's message (or, streamed, its one delta) for a tools request, and its finish_reason: the
    tool calls parsed out of the whole output, "tool_calls" where there are any and it stopped on its own."""
    content, calls = parse_output(text)
    if not calls:
        return ({"content": text} if delta else {"role": "assistant", "content": text}), finish
    if delta:
        calls = [{"index": j, **c} for j, c in enumerate(calls)]
        return {"content": content, "tool_calls": calls}, ("tool_calls" if finish == "stop" else finish)
    return ({"role": "assistant", "content": content, "tool_calls": calls},
            "tool_calls" if finish == "stop" else finish)


KEYS = {"tools", "tool_choice", "parallel_tool_calls"}
