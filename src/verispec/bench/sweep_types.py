"""The data of `verispec bench sweep` shared by the runner (bench/sweep.py) and its report (bench/sweep_report.py):
a level to run and one run's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Level:
    mode: str  # "concurrency" | "rate"
    value: float
    requests: int

    @property
    def name(self) -> str:
        return f"c={int(self.value)}" if self.mode == "concurrency" else f"rate={self.value:g}/s"


@dataclass
class LevelResult:
    endpoint: str
    level: Level
    repeat: int
    records: list[Any]
    duration_s: float
    spec: dict[str, Any] = field(default_factory=dict)
    max_in_flight: int = 0
