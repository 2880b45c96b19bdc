"""Workload prompt sets for benchmarking speculative decoding.

Shipped sets live in ``verispec/bench/workloads/<name>.jsonl``; users may pass a path to their
own JSONL file in the same format, or with lines of just ``{"prompt": ...}`` / ``{"turns": [...]}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
WORKLOADS = ("json_records", "templates", "markdown", "code", "chat")
# shipped, loaded by name, not in the default runs: agent_loop (six sessions of a tool-calling agent, four turns each,
# every turn's prompt the session so far: requests that repeat tool outputs and plans, for suffix caching across
# requests)
EXTRA_WORKLOADS = ("agent_loop",)
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class WorkloadPrompt:
    id: str
    workload: str
    messages: tuple  # of {"role": ..., "content": ...} dicts
    max_tokens: int


def _parse_line(obj: object, where: str, lineno: int, default_workload: str) -> WorkloadPrompt:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: 'messages' must be a non-empty list")
        for m in msgs:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"{where}: each message needs string 'role' and 'content'")
        messages = tuple(dict(m) for m in msgs)
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        messages = ({"role": "user", "content": obj["prompt"]},)
    elif "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        messages = ({"role": "user", "content": turns[0]},)  # single-turn: first user turn only
    else:
        raise ValueError(f"{where}: needs one of 'messages', 'prompt' or 'turns'")
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise ValueError(f"{where}: no non-empty user message")
    max_tokens = obj.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    return WorkloadPrompt(
        id=str(obj.get("id", f"{default_workload}-{lineno:02d}")),
        workload=str(obj.get("workload", default_workload)),
        messages=messages,
        max_tokens=max_tokens,
    )


def parse_jsonl(text: str, source: str, limit: int | None, parse: Callable[[object, str, int], T],
                noun: str) -> list[T]:
    """One record per non-blank line of JSONL `text` (at most `limit`), each built by `parse(obj, where, lineno)`
    and named by its `.id`; invalid JSON, duplicate ids or no record at all raise ValueError naming the line."""
    records: list[T] = []
    seen: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), 1):
        if limit is not None and len(records) >= limit:
            break
        if not line.strip():
            continue
        where = f"{source}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
        r = parse(obj, where, lineno)
        if r.id in seen:  # type: ignore[attr-defined]
            raise ValueError(f"{where}: duplicate id {r.id!r}")  # type: ignore[attr-defined]
        seen.add(r.id)  # type: ignore[attr-defined]
        records.append(r)
    if not records:
        raise ValueError(f"{source}: no {noun} found")
    return records


def _parse_text(text: str, source: str, default_workload: str, limit: int | None) -> list[WorkloadPrompt]:
    return parse_jsonl(text, source, limit, lambda obj, where, n: _parse_line(obj, where, n, default_workload),
                       "prompts")


def load_workload(name_or_path: str | Path, limit: int | None = None) -> list[WorkloadPrompt]:
    """Load a shipped workload by name, or a user JSONL file by path (first ``limit`` prompts)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    key = str(name_or_path)
    if key in WORKLOADS or key in EXTRA_WORKLOADS:
        res = resources.files("verispec.bench").joinpath("workloads", f"{key}.jsonl")
        return _parse_text(res.read_text(encoding="utf-8"), f"{key}.jsonl", key, limit)
    path = Path(name_or_path)
    if path.suffix in (".jsonl", ".json") or path.exists():
        if not path.is_file():
            raise ValueError(f"workload file {path} not found")
        return _parse_text(path.read_text(encoding="utf-8"), str(path), path.stem, limit)
    raise ValueError(f"unknown workload {key!r}: expected one of {', '.join(WORKLOADS)} or a path to a .jsonl file")


def load_workloads(names, limit: int | None = None) -> dict[str, list[WorkloadPrompt]]:
    """Load several workloads; keys are the names or paths as given."""
    return {str(n): load_workload(n, limit) for n in names}
