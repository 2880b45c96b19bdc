"""The machine's CPU load while a benchmark ran: how much of the CPUs other processes took (and, on a virtual
machine, the hypervisor: steal), so that a report says when its timings were disturbed instead of leaving it to
the reader's luck. Read from /proc/stat (the machine's busy and steal ticks) and the CPU time of this process and
of the children it waited for (`resource.getrusage`: a peer's benchmark binary the run starts is part of the run,
not a disturbance); elsewhere than Linux nothing is measured and the report says so.

Two torch processes with OpenMP threads on the same cores do not just share them: threads spin at barriers while
their partner is descheduled, and one decode step of the default model took 1.3 s instead of 12 ms beside a
training run on the 2-core reference machine. A few percent of other load is normal; tens of percent is not.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

BUSY_WARN = 0.10  # others' share of the CPUs above which a report warns


@dataclass(frozen=True)
class Ticks:
    """Cumulative CPU seconds: the machine's busy (not idle / iowait) and steal time over all CPUs, the user + system
    time of this process (threads included) and of its finished children, and the wall clock."""

    busy: float
    steal: float
    own: float
    wall: float


def parse_proc_stat(text: str, hz: float) -> tuple[float, float]:
    """/proc/stat's text -> (busy seconds, steal seconds) summed over all CPUs, from its first ('cpu') line: user
    nice system idle iowait irq softirq steal [guest guest_nice], in 1/hz s; guest time is already inside user."""
    fields = text.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        raise ValueError("not a /proc/stat 'cpu' line")
    v = [float(x) for x in fields[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq) / hz, steal / hz


def read_ticks() -> Ticks | None:
    """Now's counters, or None where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            busy, steal = parse_proc_stat(f.read(), float(os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError):
        return None
    own = sum(ru.ru_utime + ru.ru_stime for ru in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                          resource.RUSAGE_CHILDREN)))
    return Ticks(busy, steal, own, time.monotonic())


@dataclass(frozen=True)
class LoadShare:
    """Shares of the machine's CPU capacity (wall time x CPUs) over an interval."""

    others: float  # busy time not spent by this process
    own: float
    steal: float
    cpus: int
    seconds: float

    @classmethod
    def between(cls, a: Ticks, b: Ticks, cpus: int) -> "LoadShare":
        cap = max(b.wall - a.wall, 1e-9) * cpus
        own = b.own - a.own
        return cls(max(0.0, (b.busy - a.busy) - own) / cap, own / cap, max(0.0, b.steal - a.steal) / cap, cpus,
                   b.wall - a.wall)

    @property
    def disturbed(self) -> bool:
        return self.others + self.steal > BUSY_WARN

    def describe(self, others_expected: str = "") -> str:
        """One line for a report's notes; `others_expected` names processes that belong to the run (a server)."""
        who = f"other processes{' (' + others_expected + ')' if others_expected else ''}"
        line = (f"machine load over the {self.seconds:.0f} s run: {who} used {self.others:.0%} of the {self.cpus} "
                f"CPUs, this process (and its children) {self.own:.0%}, steal (the hypervisor) {self.steal:.0%}")
        if self.disturbed and not others_expected:
            line += "; WARNING: others took over 10%: the timings are disturbed, rerun on a quiet machine"
        return line


class MachineLoad:
    """`load = MachineLoad().start()`, the measured work, `load.stop()`; then `load.share` (None where nothing could
    be read). Also a context manager."""

    def __init__(self) -> None:
        self.share: LoadShare | None = None
        self._start: Ticks | None = None

    def start(self) -> "MachineLoad":
        self._start = read_ticks()
        return self

    def stop(self) -> "MachineLoad":
        end = read_ticks()
        if self._start is not None and end is not None:
            self.share = LoadShare.between(self._start, end, os.cpu_count() or 1)
        return self

    def __enter__(self) -> "MachineLoad":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self, others_expected: str = "") -> str:
        if self.share is None:
            return "machine load: not measured here (no /proc/stat)"
        return self.share.describe(others_expected)
