"""`Grade`: what every audit grader returns (a score in 0..1, pass / fail, details as plain JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Grade:
    score: float  # 0..1
    passed: bool
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert 0.0 <= self.score <= 1.0, self.score
