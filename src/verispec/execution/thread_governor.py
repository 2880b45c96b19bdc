"""How many CPU threads one forward runs on, chosen step by step by measurement, so that another process on the
machine cannot stall the engine.

A forward on N threads meets at a barrier after every parallel piece of every layer, and each barrier waits for the
slowest thread. When any other process is runnable (a niced test run, a compiler, a browser), the scheduler hands
one of the cores to it now and then, and the thread that lived there makes all the others wait: on 2 cores the
default model's plain decode fell from about 270 tok/s to 3-60 tok/s beside two `nice -n 19` processes, while the
same decode on one thread ran at about 170 tok/s (docs/results/threads.md; llama.cpp's `llama-bench` shows the same
collapse with `-t 2`). No thread count is right for every moment, so it is measured, as the kernels are.

The governor keeps, per forward size (tokens in the step), the typical step's seconds for each thread count it has
run (the current count's: the median of its latest steps; another count's: its latest probe). It runs the count that is fastest for that size, and now and then it runs one step on a neighbouring
count (one thread fewer, then one more, within 1..max_threads), which is how it notices that contention began or
ended: a probe that beats the current count's typical step by `margin` makes the probed count current. Probes are spaced
by at least `probe_every` steps of that size (doubled, up to 16x, for each probe of that count in a row that lost
and took over 16x a current step) and
by time: a probe is due once the steps since the last one took 1 / `probe_share` times what the probe is expected
to take (that count's last measurement, at most 8x a current step), so a count measured very slow (2 threads
under contention: up to a hundred times a 1-thread step) is probed rarely, and a quiet machine pays one
probe per step size: after it, on all threads, probing starts again only once the typical step has grown `wake`
times past the fastest seen.

Pure bookkeeping: it neither times nor sets anything; the runner times each forward, applies the count (only on
paths whose arithmetic does not depend on the thread count: see `execution/runner.py`) and reports back.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from verispec.config import THREAD_PROBE_EVERY, THREAD_PROBE_SHARE


def size_bucket(tokens: int) -> int:
    """Steps compared with each other: the exact token count up to 16 (decode and verify blocks, whose time barely
    grows with M), above that the power of two (prefill chunks)."""
    return tokens if tokens <= 16 else 1 << (tokens - 1).bit_length()


@dataclass
class ThreadGovernor:
    max_threads: int
    probe_every: int = THREAD_PROBE_EVERY  # steps of one size between probes of a neighbouring count, at least
    probe_share: float = THREAD_PROBE_SHARE  # probes' expected time over the time since the last probe, at most
    window: int = 9  # the current count's typical step: the median of its last this many steps
    margin: float = 0.05  # a probe must beat the current count's typical step by this share to replace it
    wake: float = 1.3  # on all threads, probes start once the typical step is this many times the best seen
    _current: dict[int, int] = field(default_factory=dict)  # size bucket -> thread count run now
    _avg: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, threads) -> seconds per step
    _recent: dict[int, deque] = field(default_factory=dict)  # bucket -> the current count's latest step seconds
    _best: dict[int, float] = field(default_factory=dict)  # bucket -> fastest typical step seen on all threads
    _steps: dict[int, int] = field(default_factory=dict)  # bucket -> steps since its last probe
    _since: dict[int, float] = field(default_factory=dict)  # bucket -> seconds of its steps since its last probe
    _probes: dict[int, int] = field(default_factory=dict)  # bucket -> probes made (their direction alternates)
    _confirm: dict[int, int] = field(default_factory=dict)  # bucket -> a count whose probe won once: probed again
    _losses: dict[tuple[int, int], int] = field(default_factory=dict)  # (bucket, count) -> probes lost in a row

    def __post_init__(self) -> None:
        if self.max_threads < 1 or self.probe_every < 2 or not 0 < self.probe_share <= 1:
            raise ValueError("need max_threads >= 1, probe_every >= 2 and 0 < probe_share <= 1")

    def current(self, tokens: int) -> int:
        """The thread count a step of `tokens` tokens runs on when it is not a probe."""
        return self._current.get(size_bucket(tokens), self.max_threads)

    def choose(self, tokens: int) -> int:
        """The thread count for the next step of `tokens` tokens: the current one, or a neighbour to probe."""
        b = size_bucket(tokens)
        self._steps[b] = self._steps.get(b, 0) + 1
        cur = self.current(tokens)
        if b in self._confirm:
            return self._confirm[b]
        if self.max_threads < 2 or self._steps[b] < self.probe_every:
            return cur
        calm = self._avg.get((b, cur), 0.0) <= self.wake * self._best.get(b, 0.0)
        if cur == self.max_threads and b in self._probes and calm:
            return cur  # probed once, all threads, steps as fast as ever: nothing to look for
        first = -1 if self._probes.get(b, 0) % 2 == 0 else 1
        mine = self._avg.get((b, cur), 0.0)
        for step in (first, -first):  # the other direction where this one is out of range or not due yet
            n = cur + step
            # what the probe should take: that count's last measurement, at most 8x a current step (a stale
            # outlier from a busy spell must not hold the count back long after the spell)
            expected = min(self._avg.get((b, n), mine), 8 * mine)
            backoff = self.probe_every << min(self._losses.get((b, n), 0), 4)  # dear lost probes space the next
            if 1 <= n <= self.max_threads and self._steps[b] >= backoff \
                    and expected <= self._since.get(b, 0.0) * self.probe_share:
                self._probes[b] = self._probes.get(b, 0) + 1
                self._steps[b], self._since[b] = 0, 0.0
                return n
        return cur

    def observe(self, tokens: int, threads: int, seconds: float) -> None:
        """A step of `tokens` tokens ran on `threads` threads in `seconds`."""
        b = size_bucket(tokens)
        cur = self.current(tokens)
        if threads == cur:
            self._since[b] = self._since.get(b, 0.0) + seconds
            recent = self._recent.setdefault(b, deque(maxlen=self.window))
            recent.append(seconds)
            self._avg[(b, cur)] = typical = statistics.median(recent)  # one hiccup moves no count
            if cur == self.max_threads and len(recent) == recent.maxlen:
                self._best[b] = min(self._best.get(b, typical), typical)
            return
        self._avg[(b, threads)] = seconds  # a probe: its own fresh measurement, not blended with a stale one
        mine = self._avg.get((b, cur))
        won = mine is not None and seconds < mine * (1 - self.margin)
        dear = mine is not None and seconds > 16 * mine  # a pathological loss: far past the expected cost's cap
        self._losses[(b, threads)] = self._losses.get((b, threads), 0) + 1 if dear else 0
        if won and self._confirm.get(b) == threads:
            self._current[b] = threads  # won twice in a row: one lucky step does not move the count
            self._recent[b] = deque([seconds], maxlen=self.window)
        if won and b not in self._confirm:
            self._confirm[b] = threads
        else:
            self._confirm.pop(b, None)
