"""Tool calling on /v1/chat/completions, the HTTP side: the request body's `tools`, `tool_choice` and
`parallel_tool_calls` read into a ToolSpec (400s name the field), and a finished choice's message with its
`tool_calls` and finish_reason "tool_calls". The format, prompt, grammar, parser and stream are verispec/tools.py's,
shared with the Python API (`LLM.chat(..., tools=...)`).
"""

from __future__ import annotations

from typing import Any, Callable

from verispec.tools import ToolSpec, check_tools, parse_output


def parse_tools(body: dict, bad: Callable[..., Exception]) -> ToolSpec | None:
    """The request's tools (None where there are none or tool_choice is "none"); 400s name the field."""
    return check_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls", True), bad)


def message(text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A chat choice's message for a tools request, and its finish_reason: the tool calls parsed out of the whole
    output, "tool_calls" where there are any and it stopped on its own. (Streamed: ToolCallStream.)"""
    content, calls = parse_output(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish
    return ({"role": "assistant", "content": content, "tool_calls": calls},
            "tool_calls" if finish == "stop" else finish)


KEYS = {"tools", "tool_choice", "parallel_tool_calls"}
