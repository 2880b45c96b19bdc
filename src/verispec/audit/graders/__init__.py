"""Offline graders, one module per audit domain; ``grade`` dispatches on the item's domain.

A grader never raises on bad model output (unparseable, wrong, crashing or looping code is a failing
grade); a malformed ``check`` is the item's fault and raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any, Protocol

from verispec.audit.graders.base import Grade

__all__ = ["Grade", "grade", "validate_item"]


class AuditItem(Protocol):  # verispec.audit.items.AuditItem (not imported: items validates checks through here)
    id: str
    domain: str
    check: Any


def _module(domain: str):
    from verispec.audit.graders import agent, coding, creative, front_end, safety

    modules = {"front_end": front_end, "agent": agent, "creative": creative, "safety": safety, "coding": coding}
    if domain not in modules:
        raise ValueError(f"no grader for domain {domain!r}: expected one of {', '.join(modules)}")
    return modules[domain]


def validate_item(item: AuditItem) -> None:
    """Raise ValueError naming the item unless its ``check`` is well-formed for its domain's grader."""
    try:
        _module(item.domain).validate(dict(item.check))
    except ValueError as e:
        raise ValueError(f"audit item {item.id!r}: {e}") from None


def grade(item: AuditItem, output: str, tool_calls: list[dict[str, Any]] | None = None) -> Grade:
    """Grade one output for one item with its domain's grader; `tool_calls` (OpenAI's, from a side that ran the item
    with tools) go to the agent grader, which grades them instead of the text where there are any."""
    text = output if isinstance(output, str) else str(output)
    if tool_calls:
        return _module(item.domain).grade(dict(item.check), text, tool_calls)
    return _module(item.domain).grade(dict(item.check), text)
