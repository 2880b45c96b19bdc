"""Creative grader: verifiable constraints on the text plus degeneration measures.

check = {                      # every key optional, at least one constraint
  "min_words": 40, "max_words": 120,
  "lines": 4, "min_lines": 3, "max_lines": 8,        # non-empty lines
  "stanzas": 3,                                      # blocks separated by blank lines
  "must_include": ["moon", "river"],                 # whole words, case-insensitive (plural -s/-es accepted)
  "forbidden": ["love"],                             # same matching; none may occur
  "acrostic": "RAIN",                                # first letters of the lines, in order
  "starts_with": "Once", "ends_with": "?",           # of the text (case-insensitive, whitespace stripped)
}
Before counting, a leading line that only introduces the text ("Here is a poem:") is dropped, and a code fence
around the whole text is unwrapped. score = fraction of constraints met, halved when the text loops; passed =
all met and no loop. Loop: a span of 1..20 words repeated back to back 3+ times covering 9+ words, or more than
half of the 4-grams repeats of earlier ones. ``details`` reports distinct-1/2 and the repeated-4-gram fraction.
"""

from __future__ import annotations

import re
from typing import Any

from verispec.audit.graders.base import Grade
from verispec.audit.graders.text import fenced_blocks, words

_INT_KEYS = ("min_words", "max_words", "lines", "min_lines", "max_lines", "stanzas")
_STR_KEYS = ("acrostic", "starts_with", "ends_with")
_LIST_KEYS = ("must_include", "forbidden")
_INTRO = re.compile(r"^\s*(?:sure|okay|ok|certainly|here(?:'s| is| are))\b.*:\s*$", re.IGNORECASE)
LOOP_PENALTY = 0.5
MIN_LOOP_WORDS = 9  # a back-to-back repeat must cover this many words ("no, no, no" is style, not a loop)


def validate(check: dict[str, Any]) -> None:
    """Raise ValueError unless ``check`` is a well-formed creative check with at least one constraint."""
    unknown = set(check) - set(_INT_KEYS + _STR_KEYS + _LIST_KEYS)
    if unknown:
        raise ValueError(f"creative check: unknown key(s) {sorted(unknown)}")
    if not check:
        raise ValueError("creative check: no constraint")
    for k in _INT_KEYS:
        if k in check and (isinstance(check[k], bool) or not isinstance(check[k], int) or check[k] < 1):
            raise ValueError(f"creative check: {k!r} must be a positive integer")
    for k in _STR_KEYS:
        if k in check and not (isinstance(check[k], str) and check[k].strip()):
            raise ValueError(f"creative check: {k!r} must be a non-empty string")
    for k in _LIST_KEYS:
        if k in check and not (isinstance(check[k], list) and all(isinstance(w, str) and w for w in check[k])):
            raise ValueError(f"creative check: {k!r} must be a list of non-empty strings")
    if "acrostic" in check and not check["acrostic"].isalpha():
        raise ValueError("creative check: 'acrostic' must be letters only")
    pairs = (("min_words", "max_words"), ("min_lines", "max_lines"), ("min_lines", "lines"), ("lines", "max_lines"))
    for lo, hi in pairs:
        if lo in check and hi in check and check[lo] > check[hi]:
            raise ValueError(f"creative check: {lo!r} > {hi!r}, no text can meet both")
    if "acrostic" in check and "lines" in check and len(check["acrostic"]) != check["lines"]:
        raise ValueError("creative check: an acrostic needs one line per letter ('lines' != its length)")
    if "stanzas" in check and "lines" in check and check["stanzas"] > check["lines"]:
        raise ValueError("creative check: more stanzas than lines")


def clean_text(output: str) -> str:
    """The creative text: a fence around it unwrapped, a leading introduction line dropped."""
    blocks = fenced_blocks(output)
    if len(blocks) == 1 and len(blocks[0][1].strip()) > 0.5 * len(output.strip()):
        output = blocks[0][1]
    lines = output.strip().splitlines()
    if len(lines) > 1 and _INTRO.match(lines[0]):
        lines = lines[1:]
    return "\n".join(lines).strip()


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word.lower())}(?:s|es)?\b", text.lower()) is not None


def _constraints(check: dict[str, Any], text: str) -> dict[str, bool]:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    stanzas = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    n_words = len(words(text))
    res: dict[str, bool] = {}
    if "min_words" in check:
        res["min_words"] = n_words >= check["min_words"]
    if "max_words" in check:
        res["max_words"] = n_words <= check["max_words"]
    if "lines" in check:
        res["lines"] = len(lines) == check["lines"]
    if "min_lines" in check:
        res["min_lines"] = len(lines) >= check["min_lines"]
    if "max_lines" in check:
        res["max_lines"] = len(lines) <= check["max_lines"]
    if "stanzas" in check:
        res["stanzas"] = len(stanzas) == check["stanzas"]
    for w in check.get("must_include", []):
        res[f"includes {w}"] = _has_word(text, w)
    for w in check.get("forbidden", []):
        res[f"avoids {w}"] = not _has_word(text, w)
    if "acrostic" in check:
        firsts = "".join((re.findall(r"[A-Za-z]", ln) or ["?"])[0] for ln in lines)
        res["acrostic"] = firsts.upper() == check["acrostic"].upper()
    if "starts_with" in check:
        res["starts_with"] = text.lower().startswith(check["starts_with"].strip().lower())
    if "ends_with" in check:
        res["ends_with"] = text.lower().rstrip().endswith(check["ends_with"].strip().lower())
    return res


def _distinct(tokens: list[str], n: int) -> float:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def _longest_repeat(tokens: list[str], max_span: int = 20) -> tuple[int, int]:
    """The most back-to-back copies of any span of 1..max_span tokens: (copies, span)."""
    best = (1, 0)
    for span in range(1, max_span + 1):
        for start in range(0, max(0, len(tokens) - 2 * span + 1)):
            copies, j = 1, start + span
            while tokens[j:j + span] == tokens[start:start + span] and j + span <= len(tokens):
                copies, j = copies + 1, j + span
            if copies > best[0]:
                best = (copies, span)
    return best


def degeneration(text: str) -> dict[str, Any]:
    """distinct-1/2, the fraction of 4-grams repeating an earlier one, the longest back-to-back repeat, looping."""
    tokens = [w.lower() for w in words(text)]
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    rep4 = (1.0 - len(set(grams)) / len(grams)) if grams else 0.0
    copies, span = _longest_repeat(tokens)
    looping = (copies >= 3 and copies * span >= MIN_LOOP_WORDS) or rep4 > 0.5
    return {"distinct_1": round(_distinct(tokens, 1), 4), "distinct_2": round(_distinct(tokens, 2), 4),
            "repeated_4gram_fraction": round(rep4, 4), "longest_repeat": {"copies": copies, "span_words": span},
            "looping": looping}


def grade(check: dict[str, Any], output: str) -> Grade:
    validate(check)
    text = clean_text(output)
    res = _constraints(check, text)
    deg = degeneration(text)
    frac = sum(res.values()) / len(res)
    score = frac * (LOOP_PENALTY if deg["looping"] else 1.0)
    details = {"met": sum(res.values()), "constraints": len(res),
               "failed": [k for k, ok in res.items() if not ok], "words": len(words(text)), **deg}
    return Grade(score, bool(frac == 1.0 and not deg["looping"]), details)
