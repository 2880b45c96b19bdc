"""OpenMP thread pools handed over with the engine (kernels/threads.py).

Oracle: the operating system's own list of this process's threads (/proc/self/task): OpenMP's pool threads of the
calling thread exist after a parallel region and are gone after the release; and torch's results, which must not
change when the pool is made again.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from verispec.kernels.threads import loaded_openmp, release_openmp_threads

TASKS = Path("/proc/self/task")
pytestmark = pytest.mark.skipif(not TASKS.exists() or torch.get_num_threads() < 2 or not loaded_openmp(),
                                reason="needs Linux, 2+ torch threads and an OpenMP runtime with omp_pause")


CHILD = """
import os, torch
from verispec.kernels.threads import release_openmp_threads
n = lambda: len(os.listdir("/proc/self/task"))
x = torch.arange(4_000_000, dtype=torch.float64)
expected = (x * 2).sum()  # large enough for torch to open a parallel region on its OpenMP threads
with_pool = n()
released = release_openmp_threads()
after = n()
again = (x * 2).sum()
print(torch.get_num_threads(), with_pool, released, after, n(), bool(torch.equal(again, expected)))
"""


def test_release_frees_the_calling_threads_pool_and_it_comes_back_on_use():
    """In a fresh process (no other test's threads coming and going): the pool's threads exist after a parallel
    region, are gone after the release, come back on the next one, and the result is the same."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    threads, with_pool, released, after, again, same = out.stdout.split()
    assert int(released) >= 1
    assert int(after) == int(with_pool) - (int(threads) - 1), "the pool's threads are gone"
    assert int(again) == int(with_pool) and same == "True", "made again on the next parallel region, same result"


def test_building_and_starting_release_the_threads_pool(monkeypatch, tiny_dir: Path):
    """The server builds the LLM on its main thread (profiles run there) and steps it on a worker: building the
    LLM and start() each give that thread's OpenMP threads back, so the worker's are the process's only ones."""
    from verispec import LLM, SamplingParams
    from verispec.engine import background

    from verispec import api

    released: list[tuple[str, int]] = []
    for module in (api, background):
        monkeypatch.setattr(module, "release_openmp_threads", lambda name=module.__name__: released.append(
            (name, threading.get_ident())) or release_openmp_threads())
    llm = LLM(str(tiny_dir), dtype="float32", progress=False)
    assert released == [("verispec.api", threading.get_ident())], "building gives this thread's pool back"
    bg = background.BackgroundEngine(llm.engine, llm.check_prompt_ids)
    bg.start()
    try:
        events = list(bg.submit([1, 5, 9], SamplingParams(temperature=0.0, max_tokens=3)).events(timeout=60))
    finally:
        bg.shutdown()
    assert released[1:] == [("verispec.engine.background", threading.get_ident())], "and so does start()"
    assert sum(len(e.token_ids) for e in events) == 3
