"""The machine load a benchmark report states: /proc/stat's busy and steal ticks against hand-computed values, the
shares over an interval, and a real busy neighbour process seen as other load."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from verispec.bench.load import LoadShare, MachineLoad, Ticks, parse_proc_stat, read_ticks


def test_proc_stat_busy_and_steal_are_the_first_lines_ticks_in_seconds() -> None:
    text = "cpu  100 5 50 1000 20 3 2 7 11 0\ncpu0 50 2 25 500 10 1 1 3 5 0\nintr 1\n"
    busy, steal = parse_proc_stat(text, 100.0)
    assert busy == pytest.approx((100 + 5 + 50 + 3 + 2) / 100)  # user nice system irq softirq; guest is in user
    assert steal == pytest.approx(0.07)
    with pytest.raises(ValueError):
        parse_proc_stat("intr 1 2 3\n", 100.0)


def test_shares_of_the_cpus_over_an_interval() -> None:
    a, b = Ticks(busy=10.0, steal=0.0, own=1.0, wall=100.0), Ticks(busy=14.0, steal=0.2, own=2.0, wall=102.0)
    s = LoadShare.between(a, b, cpus=2)  # capacity 2 s x 2 CPUs = 4 CPU-seconds
    assert (s.others, s.own, s.steal, s.seconds) == pytest.approx((0.75, 0.25, 0.05, 2.0))
    assert s.disturbed and "WARNING" in s.describe() and "75% of the 2 CPUs" in s.describe()
    assert "WARNING" not in s.describe("the server")  # others that belong to the run are stated, not warned about
    quiet = LoadShare.between(a, Ticks(11.1, 0.0, 2.0, 102.0), cpus=2)
    assert quiet.others == pytest.approx(0.025) and not quiet.disturbed and "WARNING" not in quiet.describe()


@pytest.mark.skipif(read_ticks() is None, reason="no /proc/stat here")
def test_a_busy_neighbour_process_is_counted_as_other_load_and_our_sleep_as_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.5)  # the child is running
        with MachineLoad() as load:
            time.sleep(1.5)
    finally:
        child.kill()
        child.wait()
    s = load.share
    cpus = os.cpu_count() or 1
    assert s is not None and s.cpus == cpus and s.seconds == pytest.approx(1.5, abs=0.3)
    assert s.others >= 0.6 / cpus, s  # one spinning core (others on a shared machine only add)
    assert s.own < 0.05, s  # sleeping costs this process nothing
