"""Agent grader: a JSON tool call extracted from the output, checked against the item's tool schemas.

check = {
  "tools": [{"name": "get_weather", "description": "...", "parameters": {JSON schema}}, ...],
  "expected_tool": "get_weather",
  "expected_args": {"city": "Paris"},   # optional: argument values that must match (strings case-insensitive)
}
The call is the first JSON object in the output (fenced or not) with a tool name: ``{"name": ..., "arguments":
{...}}``; ``tool`` / ``function`` for the name, ``args`` / ``parameters`` / ``arguments`` (an object or a JSON
string) for the arguments, and OpenAI's ``{"function": {"name", "arguments"}}`` are accepted too. A call naming a
tool that is not in ``tools`` anywhere in the output (an invented tool) scores 0; a tool definition echoed from
the prompt (arguments that are a JSON schema) is not a call. Otherwise the first call is graded: score = mean of
four parts: a call parsed, the right tool, its arguments valid against that tool's schema (jsonschema), and the
fraction of ``expected_args`` met (the last two count only for the right tool). passed = all four in full.

Where the item was run with real tools (``tools=`` on LLM.chat or the endpoint's request) and the response carries
OpenAI ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments": JSON text}}]``), those calls are
graded the same way instead of the text; without tool calls the text is graded as above.
"""

from __future__ import annotations

import json
from typing import Any

from verispec.audit.graders.base import Grade

_NAME_KEYS = ("name", "tool", "tool_name", "function")
_ARG_KEYS = ("arguments", "args", "parameters", "input")


def validate(check: dict[str, Any]) -> None:
    """Raise ValueError unless ``check`` is a well-formed agent check."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    tools = check.get("tools")
    if not isinstance(tools, list) or not tools:
        raise ValueError("agent check: 'tools' must be a non-empty list")
    names = []
    for t in tools:
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("parameters"), dict)):
            raise ValueError(f"agent check: each tool needs a string 'name' and a 'parameters' schema: {t!r}")
        try:
            Draft202012Validator.check_schema(t["parameters"])
        except SchemaError as e:
            raise ValueError(f"agent check: tool {t['name']!r} has an invalid schema ({e.message})") from None
        names.append(t["name"])
    if len(set(names)) != len(names):
        raise ValueError("agent check: duplicate tool names")
    if check.get("expected_tool") not in names:
        raise ValueError(f"agent check: 'expected_tool' must be one of {names}")
    exp = check.get("expected_args", {})
    if not isinstance(exp, dict):
        raise ValueError("agent check: 'expected_args' must be an object")
    tool = next(t for t in tools if t["name"] == check["expected_tool"])
    errors = list(Draft202012Validator(tool["parameters"]).iter_errors(exp))
    if errors and set(exp) >= set(tool["parameters"].get("required", [])):
        raise ValueError(f"agent check: 'expected_args' do not fit the schema ({errors[0].message})")


def _json_objects(text: str) -> list[dict]:
    """Every top-level JSON object in ``text``, scanning from each '{' (objects nested in one found are skipped)."""
    dec = json.JSONDecoder()
    found, i = [], text.find("{")
    while i != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict):
            found.append(obj)
        i = text.find("{", end)
    return found


def as_call(obj: dict) -> tuple[str, Any] | None:
    """``(tool name, arguments)`` if ``obj`` looks like a tool call, else None."""
    fn = obj.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        obj = fn
    name = next((obj[k] for k in _NAME_KEYS if isinstance(obj.get(k), str)), None)
    if name is None:
        return None
    args = next((obj[k] for k in _ARG_KEYS if k in obj), {})
    if isinstance(args, dict) and args.get("type") == "object" and "properties" in args:
        return None  # a tool definition echoed from the prompt (its parameters schema), not a call
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return name, args


def _same(want: Any, got: Any) -> bool:
    if isinstance(want, str) and isinstance(got, str):
        return " ".join(want.casefold().split()) == " ".join(got.casefold().split())
    if isinstance(want, bool) or isinstance(got, bool):
        return want is got
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return abs(want - got) <= 1e-9 * max(1.0, abs(want))
    if isinstance(want, list) and isinstance(got, list):
        return len(want) == len(got) and all(_same(a, b) for a, b in zip(want, got))
    if isinstance(want, dict) and isinstance(got, dict):
        return set(want) == set(got) and all(_same(want[k], got[k]) for k in want)
    return want == got


def grade(check: dict[str, Any], output: str, tool_calls: list[dict[str, Any]] | None = None) -> Grade:
    """The output's first tool call graded: from `tool_calls` (OpenAI's, parsed by the side that ran the item with
    tools) where there are any, else the first JSON call in the text."""
    from jsonschema import Draft202012Validator

    validate(check)
    tools = {t["name"]: t for t in check["tools"]}
    source = "tool_calls" if tool_calls else "text"
    found = [c for c in tool_calls or () if isinstance(c, dict)] if tool_calls else _json_objects(output)
    calls = [c for c in map(as_call, found) if c is not None]
    if not calls:
        return Grade(0.0, False, {"error": "no JSON tool call found", "source": source})
    invented = sorted({n for n, _ in calls if n not in tools})
    if invented:
        return Grade(0.0, False, {"error": "invented tool(s)", "invented": invented, "called": calls[0][0],
                                  "source": source})
    name, args = calls[0]
    right = name == check["expected_tool"]
    errors = ["arguments are not an object"] if not isinstance(args, dict) else [
        f"{'/'.join(map(str, e.path)) or '(root)'}: {e.message}"
        for e in Draft202012Validator(tools[name]["parameters"]).iter_errors(args)]
    exp = check.get("expected_args", {})
    got = args if isinstance(args, dict) else {}
    wrong = sorted(k for k, v in exp.items() if not (k in got and _same(v, got[k])))
    values = (1.0 - len(wrong) / len(exp)) if exp else 1.0
    values = values if right else 0.0
    score = (1.0 + right + (not errors and right) + values) / 4.0
    details = {"called": name, "right_tool": right, "schema_errors": errors[:5], "wrong_values": wrong,
               "source": source}
    return Grade(score, bool(right and not errors and not wrong), details)
