"""OpenMP thread pools when the engine moves to another thread.

OpenMP (libgomp, which torch and verispec's kernel share on Linux) keeps one thread pool per thread that opened a
parallel region. A thread that built the model (and ran the kernel's profile there) keeps its pool when the engine
then runs on a worker thread, as in the server: the process then manages more OpenMP threads than it has CPUs, and
libgomp stops spinning at its barriers and sleeps instead (its "throttled" wait), so every barrier of every layer
costs a futex wake-up. Measured on 2 cores: a decode step of the default model took 10.2 ms on the server's worker
thread against 3.5 ms on the thread that built it (`benchmarks/studies/worker_thread.py`). Releasing the building
thread's pool before handing the engine over brings the worker to the same speed (`LLM` does it once built,
`BackgroundEngine.start()` on the starting thread); the pool is made again if that thread
ever opens a parallel region again.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from typing import Iterator

log = logging.getLogger(__name__)

# GNU's only: its pause frees the calling thread's own pool and nothing else, however many threads run parallel
# regions meanwhile, and its barrier throttling is what the hand-over trips. LLVM's and Intel's runtimes share one
# pool between threads, and their pause stops the whole runtime: not something to do with a server running.
OPENMP_LIBRARIES = ("libgomp.so.1",)
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the runtime's state


def loaded_openmp() -> list[ctypes.CDLL]:
    """The OpenMP runtimes of OPENMP_LIBRARIES already loaded in this process (never loads one: RTLD_NOLOAD)."""
    if not hasattr(os, "RTLD_NOLOAD"):
        return []  # no way to ask without loading one (not POSIX)
    mode = os.RTLD_NOLOAD | os.RTLD_LAZY
    found = []
    for name in OPENMP_LIBRARIES:
        try:
            lib = ctypes.CDLL(name, mode=mode)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            found.append(lib)
    return found


def release_openmp_threads() -> int:
    """Free the calling thread's OpenMP thread pool (OpenMP 5.0's omp_pause_resource_all(omp_pause_soft)) in GNU's
    runtime, where loaded. Call it on the thread that built an engine, before another thread runs it. Returns how
    many runtimes released; 0 where none is loaded or it lacks the call (nothing changes then)."""
    released = 0
    for lib in loaded_openmp():
        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        lib.omp_pause_resource_all.restype = ctypes.c_int
        if lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0:
            released += 1
    log.debug("released this thread's OpenMP threads in %d runtime(s)", released)
    return released


_LOCAL = threading.local()  # this thread's kernel thread count, while a governor sets one


def kernel_threads() -> int:
    """The thread count verispec's CPU kernel runs its next call on: the calling thread's `kernel_thread_count`
    while one is set, else torch's. The kernel takes the count per call (OpenMP's num_threads clause), so changing
    it costs nothing, where torch.set_num_threads costs about a millisecond each time (it resizes the pool)."""
    n = getattr(_LOCAL, "threads", None)
    if n is not None:
        return n
    import torch

    return torch.get_num_threads()


@contextlib.contextmanager
def kernel_thread_count(n: int) -> Iterator[None]:
    """Run verispec's kernel calls made on this thread inside the block on `n` threads (torch's own ops are not
    affected)."""
    before = getattr(_LOCAL, "threads", None)
    _LOCAL.threads = n
    try:
        yield
    finally:
        _LOCAL.threads = before
