"""Audit items: the shipped domain prompt sets (``audit/domains/<domain>.jsonl``) or a user's JSONL.

One JSON object per line: ``{"id", "domain", "messages": [{"role": "system"|"user", "content"}],
"max_tokens", "check": {...}}``; ``check`` is the grader's spec for that domain (see ``audit/graders``).
Loading checks the item's shape; ``audit.graders.validate_item`` checks its ``check`` against its grader.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from verispec.bench.workloads import parse_jsonl

DOMAINS = ("front_end", "agent", "creative", "safety", "coding")
_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class AuditItem:
    id: str
    domain: str
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    check: Mapping[str, Any]

    def __post_init__(self) -> None:
        assert self.domain in DOMAINS, self.domain
        assert self.messages and self.max_tokens > 0
        assert isinstance(self.check, Mapping)


def _parse_messages(msgs: object, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    for m in msgs:
        if not (isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: each message needs a 'role' in {_ROLES} and a string 'content'")
    if not any(m["role"] == "user" and m["content"].strip() for m in msgs):
        raise ValueError(f"{where}: no non-empty user message")
    return tuple({"role": m["role"], "content": m["content"]} for m in msgs)


def _parse_item(obj: object, where: str) -> AuditItem:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("id", "domain", "messages", "max_tokens", "check") if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    if obj["domain"] not in DOMAINS:
        raise ValueError(f"{where}: unknown domain {obj['domain']!r}: expected one of {', '.join(DOMAINS)}")
    max_tokens = obj["max_tokens"]
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    if not isinstance(obj["check"], dict):
        raise ValueError(f"{where}: 'check' must be a JSON object")
    return AuditItem(
        id=str(obj["id"]),
        domain=obj["domain"],
        messages=_parse_messages(obj["messages"], where),
        max_tokens=max_tokens,
        check=obj["check"],
    )


def _parse_text(text: str, source: str, limit: int | None) -> list[AuditItem]:
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    return parse_jsonl(text, source, limit, lambda obj, where, _: _parse_item(obj, where), "audit items")


def load_domain(name: str, limit: int | None = None) -> list[AuditItem]:
    """The shipped items of one domain (the first ``limit``)."""
    if name not in DOMAINS:
        raise ValueError(f"unknown audit domain {name!r}: expected one of {', '.join(DOMAINS)}")
    res = resources.files("verispec.audit").joinpath("domains", f"{name}.jsonl")
    items = _parse_text(res.read_text(encoding="utf-8"), f"{name}.jsonl", limit)
    wrong = [i.id for i in items if i.domain != name]
    if wrong:
        raise ValueError(f"{name}.jsonl: items of another domain: {', '.join(wrong)}")
    return items


def load_items(path: str | Path, limit: int | None = None) -> list[AuditItem]:
    """A user's JSONL of audit items in the shipped format (the first ``limit``)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"audit items file {p} not found")
    return _parse_text(p.read_text(encoding="utf-8"), str(p), limit)
