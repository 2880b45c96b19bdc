"""Text helpers shared by the graders: markdown code fences, words, sentences."""

from __future__ import annotations

import re

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_WORD = re.compile(r"[A-Za-z0-9]+(?:['\u2019][A-Za-z]+)*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every markdown code fence, in order; an unclosed last fence runs to the end."""
    return [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]


def words(text: str) -> list[str]:
    """The words of ``text`` (letters and digits, with inner apostrophes), as written."""
    return _WORD.findall(text)


def first_sentences(text: str, n: int, max_chars: int) -> str:
    """The first ``n`` sentences (or lines) of ``text``, at most ``max_chars`` characters."""
    parts = [p for p in _SENTENCE_END.split(text.strip()) if p.strip()]
    return " ".join(parts[:n])[:max_chars]
