"""Repeated log lines, rate-limited: a flood of connections or bad requests must not flood the log too.

Under ~20,000 connections the server once logged 448,362 `Too many open files` tracebacks (181 MB in 25 s). A
`RepeatFilter` lets through the first `burst` records of each kind (logger, message template, exception type) in
every `window` seconds, drops the rest, and when the kind next gets through says how many it dropped.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

# the loggers a flood can make repeat themselves: uvicorn's errors, asyncio's failed accepts, our own (uvicorn's
# access log says one line per request, which is what it is for; --log-level warning turns it off)
FLOOD_LOGGERS = ("uvicorn.error", "asyncio", "verispec.server")
DEFAULT_BURST = 5
DEFAULT_WINDOW = 10.0


class RepeatFilter(logging.Filter):
    """At most `burst` records of one kind per `window` seconds; the next one let through carries the count of
    those dropped since (`... (N similar lines dropped)`)."""

    def __init__(self, burst: int = DEFAULT_BURST, window: float = DEFAULT_WINDOW,
                 clock: Callable[[], float] = time.monotonic, max_kinds: int = 1024) -> None:
        super().__init__()
        if burst < 1 or not window > 0:
            raise ValueError(f"need burst >= 1 and window > 0, got {burst}, {window}")
        self.burst, self.window, self.clock, self.max_kinds = burst, window, clock, max_kinds
        self._seen: dict[tuple, list] = {}  # kind -> [window start, records let through in it, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        kind = (record.name, str(record.msg), exc)
        now = self.clock()
        seen = self._seen.get(kind)
        if seen is None or now - seen[0] >= self.window:
            dropped = seen[2] if seen is not None else 0
            if seen is None and len(self._seen) >= self.max_kinds:  # forget old kinds rather than grow
                self._seen.clear()
            self._seen[kind] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} ({dropped} similar lines dropped in the last {self.window:g} s)"
            return True
        if seen[1] < self.burst:
            seen[1] += 1
            return True
        seen[2] += 1
        return False


def install(burst: int = DEFAULT_BURST, window: float = DEFAULT_WINDOW,
            names: tuple[str, ...] = FLOOD_LOGGERS) -> RepeatFilter:
    """One RepeatFilter on each of `names` (a logger's filters see the records logged to it directly); returns
    it. Installing again replaces the earlier one."""
    flt = RepeatFilter(burst, window)
    for name in names:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, RepeatFilter)]:
            logger.removeFilter(old)
        logger.addFilter(flt)
    return flt
