"""Spec-Bench (Xia et al., 2024) as a workload: its question file read per category, and its tables' grouping.

Spec-Bench's `data/spec_bench/question.jsonl` (fetched by the user, never shipped) holds one question per line:
`question_id`, `category` (13 of them: the eight MT-bench categories, then translation, summarization, qa,
math_reasoning, rag), `turns` (the user turns; the first is sent, as single-turn benchmarks do) and sometimes
`reference`. `load_spec_bench` gives the first `per_category` questions of each category as workload prompts, in
the file's category order. Spec-Bench's own tables report six tasks, the eight MT-bench categories pooled as
"Multi-turn Conversation"; `task_of` maps a category to its task, and `spec_bench_rows` builds both tables
(per category and per task) from per-prompt speed ratios and tokens per target forward.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from verispec.bench.workloads import DEFAULT_MAX_TOKENS, WorkloadPrompt, parse_jsonl

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
# Spec-Bench's tasks in its tables' column order, each with the categories it pools
TASKS: dict[str, tuple[str, ...]] = {
    "Multi-turn Conversation": MT_BENCH,
    "Translation": ("translation",),
    "Summarization": ("summarization",),
    "Question Answering": ("qa",),
    "Mathematical Reasoning": ("math_reasoning",),
    "Retrieval-aug. Generation": ("rag",),
}
CATEGORIES = tuple(c for cats in TASKS.values() for c in cats)


def task_of(category: str) -> str:
    """Spec-Bench's task of a category (an unknown category is its own task)."""
    return next((t for t, cats in TASKS.items() if category in cats), category)


def _parse(obj: object, where: str, lineno: int, max_tokens: int) -> WorkloadPrompt:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    turns, category = obj.get("turns"), obj.get("category")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise ValueError(f"{where}: 'turns' must be a non-empty list whose first turn is a non-empty string")
    if not isinstance(category, str) or not category:
        raise ValueError(f"{where}: 'category' must be a non-empty string")
    qid = obj.get("question_id", lineno)
    return WorkloadPrompt(id=f"{category}-{qid}", workload=category,
                          messages=({"role": "user", "content": turns[0]},), max_tokens=max_tokens)


def load_spec_bench(path: str | Path, per_category: int | None = None, categories: Iterable[str] | None = None,
                    max_tokens: int = DEFAULT_MAX_TOKENS) -> dict[str, list[WorkloadPrompt]]:
    """Category -> its first `per_category` questions (all where None) of a Spec-Bench question file, in the file's
    order of categories; `categories` keeps only those (each must occur in the file)."""
    if per_category is not None and per_category < 1:
        raise ValueError(f"per_category must be >= 1, got {per_category}")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"Spec-Bench question file {p} not found (Spec-Bench's data/spec_bench/question.jsonl)")
    prompts = parse_jsonl(p.read_text(encoding="utf-8"), str(p), None,
                          lambda obj, where, n: _parse(obj, where, n, max_tokens), "questions")
    out: dict[str, list[WorkloadPrompt]] = {}
    for wp in prompts:
        got = out.setdefault(wp.workload, [])
        if per_category is None or len(got) < per_category:
            got.append(wp)
    if categories is not None:
        wanted = list(categories)
        missing = [c for c in wanted if c not in out]
        if missing:
            raise ValueError(f"{p}: no question of categor{'y' if len(missing) == 1 else 'ies'} "
                             f"{', '.join(missing)} (the file has {', '.join(out)})")
        out = {c: out[c] for c in wanted}
    return out


def geomean(xs: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


@dataclass(frozen=True)
class Run:
    """One prompt's result for one method: its category, output tok/s over the baseline's on the same prompt and
    repeat, tokens per target forward, and whether its output equals the baseline's."""

    category: str
    ratio: float
    tau: float
    identical: bool


def spec_bench_rows(runs: Iterable[Run]) -> tuple[list[dict], list[dict]]:
    """(per category, per task) rows as Spec-Bench's tables: the speedup (geometric mean of the per-prompt
    ratios), its range, the mean accepted tokens (tau), identical outputs; the task table ends with Overall."""
    by_cat: dict[str, list[Run]] = {}
    for r in runs:
        by_cat.setdefault(r.category, []).append(r)
    order = [c for c in CATEGORIES if c in by_cat] + [c for c in by_cat if c not in CATEGORIES]

    def row(name: str, xs: list[Run]) -> dict:
        ratios = [x.ratio for x in xs]
        return {"name": name, "speedup": geomean(ratios), "min": min(ratios), "max": max(ratios),
                "tau": statistics.fmean(x.tau for x in xs), "identical": f"{sum(x.identical for x in xs)}/{len(xs)}"}

    cats = [row(c, by_cat[c]) for c in order]
    tasks: dict[str, list[Run]] = {}
    for c in order:
        tasks.setdefault(task_of(c), []).extend(by_cat[c])
    task_rows = [row(t, xs) for t, xs in tasks.items()]
    task_rows.append(row("Overall", [x for c in order for x in by_cat[c]]))
    return cats, task_rows


def markdown(rows: Sequence[Mapping], first: str) -> str:
    """A table of `spec_bench_rows` rows, its first column headed `first`."""
    lines = [f"| {first} | speedup (geo. mean) | min..max | mean accepted tokens | identical |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | x{r['speedup']:.2f} | {r['min']:.2f}..{r['max']:.2f} | {r['tau']:.2f} | "
              f"{r['identical']} |" for r in rows]
    return "\n".join(lines)

