"""The CPU thread governor (execution/thread_governor.py): on a simulated machine whose step times change with
contention it moves to the fastest thread count within a bounded number of steps and back when contention ends,
pays about one probe in `probe_every` steps on a quiet machine; and the paths it runs on compute the same logits
whatever the thread count, so the engine's tokens do not depend on its choices."""

from __future__ import annotations

import pytest
import torch

from verispec.execution.thread_governor import ThreadGovernor, size_bucket


def drive(gov: ThreadGovernor, seconds, steps: int, tokens: int = 1) -> list[int]:
    """Run `steps` steps of `tokens` tokens, each taking seconds(threads); the thread counts the governor chose."""
    chosen = []
    for _ in range(steps):
        n = gov.choose(tokens)
        gov.observe(tokens, n, seconds(n))
        chosen.append(n)
    return chosen


QUIET = {1: 5.9e-3, 2: 3.7e-3}.get  # the default model's decode step on the 2-core machine, alone
BUSY = {1: 6.0e-3, 2: 30e-3}.get  # beside a niced busy process: the 2-thread barriers wait for a preempted thread


def probe_share(chosen: list[int], seconds, current: int) -> float:
    """The share of the time spent on probes (steps not on `current` threads)."""
    total = sum(seconds(n) for n in chosen)
    return sum(seconds(n) for n in chosen if n != current) / total


def test_quiet_machine_keeps_all_threads_and_pays_only_the_probes():
    gov = ThreadGovernor(2, probe_every=64, probe_share=0.02)
    chosen = drive(gov, QUIET, 64 * 20)
    assert gov.current(1) == 2
    assert chosen.count(1) == 1  # one probe, lost; then nothing to look for while steps stay as fast


def test_contention_moves_to_fewer_threads_and_back_within_bounded_steps():
    gov = ThreadGovernor(2, probe_every=16, probe_share=0.02)
    drive(gov, QUIET, 200)
    chosen = drive(gov, BUSY, 2 * 16)  # the first probe after contention begins wins
    assert gov.current(1) == 1 and chosen[-1] == 1
    busy_tail = drive(gov, BUSY, 2000)
    # the slow count is probed by time: its probes take about probe_share of the time, not one step in 16
    assert busy_tail.count(2) <= 2000 * BUSY(1) * 0.02 / BUSY(2) + 1
    assert probe_share(busy_tail, BUSY, 1) <= 0.03
    # contention ends: an upward probe is due once the steps since the last one took 1 / probe_share times the
    # slow probe's time (50 x 30 ms = 1.5 s: 250 quiet steps at 1 thread), and it wins
    back = drive(gov, QUIET, 300)
    assert gov.current(1) == 2 and back[-1] == 2


def test_many_cores_step_down_one_thread_at_a_time_to_the_best_count():
    times = {8: 40e-3, 7: 9e-3, 6: 7e-3, 5: 8e-3, 4: 9e-3, 3: 11e-3, 2: 15e-3, 1: 28e-3}.get  # one core taken
    gov = ThreadGovernor(8, probe_every=8)
    drive(gov, times, 8 * 100)
    assert gov.current(1) == 6


def test_sizes_are_governed_apart():
    gov = ThreadGovernor(2, probe_every=8)
    prefill = {1: 0.20, 2: 0.11}.get  # a 512-token chunk: compute-bound, two threads pay even under contention
    for _ in range(20):
        drive(gov, BUSY, 8, tokens=1)
        drive(gov, prefill, 8, tokens=512)
    assert gov.current(1) == 1 and gov.current(512) == 2
    assert size_bucket(5) == 5 and size_bucket(17) == 32 and size_bucket(512) == 512


def test_noisy_probe_does_not_flap():
    gov = ThreadGovernor(2, probe_every=8, margin=0.05)
    drive(gov, {1: 3.6e-3, 2: 3.7e-3}.get, 200)  # within the margin: no reason to leave the current count
    assert gov.current(1) == 2


def test_bad_arguments():
    with pytest.raises(ValueError):
        ThreadGovernor(0)
    with pytest.raises(ValueError):
        ThreadGovernor(2, probe_every=1)
    with pytest.raises(ValueError):
        ThreadGovernor(2, probe_share=0)


def kernel_or_skip() -> None:
    from verispec.kernels.cpu_kernels import KernelUnavailable, load

    try:
        load()
    except KernelUnavailable as e:
        pytest.skip(f"verispec's CPU kernel cannot be built here: {e}")


@pytest.mark.slow
def test_kernel_path_computes_the_same_logits_on_any_thread_count():
    """The governor runs only on gguf-q8act: a prompt's logits (all rows) and a one-token step's are bitwise equal
    with the kernel on 1 and on 2 threads (the default model's real shapes, so the kernel really splits the work)."""
    from verispec import LLM
    from verispec.kernels.threads import kernel_thread_count
    from verispec.models.llama import Segment

    kernel_or_skip()
    llm = LLM(quantization="gguf-q8act", device="cpu", progress=False, max_model_len=128)
    model = llm.model
    ids = torch.arange(40) * 37 % 1000 + 5
    logits = {}
    for threads in (2, 1):
        with kernel_thread_count(threads):
            cache = model.new_cache(64)
            prompt = model(ids, [Segment(cache.allocate(), 0, 40)], cache, logits_indices=list(range(40))).logits
            cache = model.new_cache(64)
            one = model(ids[:1], [Segment(cache.allocate(), 0, 1)], cache, logits_indices=[0]).logits
        logits[threads] = (prompt.clone(), one.clone())
    assert torch.equal(logits[1][0], logits[2][0])
    assert torch.equal(logits[1][1], logits[2][1])


@pytest.mark.slow
def test_engine_tokens_do_not_depend_on_the_governors_choices():
    """Greedy speculative decoding with a governor probing every other step (thread counts alternating all the
    time) gives the tokens of plain decoding without one."""
    from verispec import LLM, SamplingParams

    kernel_or_skip()
    plain = LLM(quantization="gguf-q8act", device="cpu", progress=False, max_model_len=256, adaptive_threads=False)
    spec = plain.with_speculation({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    spec.engine.runner.threads = ThreadGovernor(2, probe_every=2, probe_share=1.0)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = ["1, 2, 3, 4, 5,", "The capital of France is"]
    a = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    b = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert a == b
    assert spec.engine.runner.threads._probes  # it did switch counts
    assert plain.engine.runner.threads is None


@pytest.mark.slow
def test_adaptive_threads_builds_a_governor_on_the_kernel_path_only():
    from verispec import LLM

    kernel_or_skip()
    on = LLM(quantization="gguf-q8act", device="cpu", progress=False, max_model_len=128, adaptive_threads=True)
    assert on.engine.runner.threads is not None and on.engine.runner.threads.max_threads == torch.get_num_threads()
    int4 = LLM(quantization="gguf", dtype="bfloat16", device="cpu", progress=False, max_model_len=128,
               adaptive_threads=True)
    assert int4.engine.runner.threads is None  # aten's int4 kernel takes torch's thread count, not the governor's
