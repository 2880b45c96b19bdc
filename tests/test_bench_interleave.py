"""The interleaved arms of a single-stream comparison (bench/interleave.py), on stand-in engines that record the
order they were called in and return fixed outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verispec.bench.interleave import ArmRun, per_prompt_ratios, phase_row, pooled_ratios, run_interleaved
from verispec.engine.counters import StepClock


class _Drafters:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def reset_shared(self) -> None:
        self.log.append((self.name, "reset"))


class _Arm:
    def __init__(self, name: str, log: list, tokens: dict[int, list[int]]) -> None:
        self.name, self.log, self.tokens = name, log, tokens
        self.drafters = _Drafters(name, log)
        self.engine = SimpleNamespace(clock=StepClock())

    def chat(self, conversations, params, use_tqdm=False):
        prompt = conversations[0][0]["content"]
        self.log.append((self.name, prompt))
        for _ in range(prompt + 1):  # prompt i runs i + 1 steps of 1 ms schedule, 2 draft, 3 forward, 4 commit
            self.engine.clock.record(1, schedule=1e-3, draft=2e-3, forward=3e-3, commit=4e-3)
        stats = {"mean_acceptance_length": 2.0, "steps": 4, "num_draft_tokens": 6, "ttft_s": 0.25}
        return [SimpleNamespace(token_ids=self.tokens[prompt], stats=stats)]


def test_every_prompt_and_repeat_runs_every_arm_in_rotating_order_and_identity_is_against_the_baseline():
    log: list = []
    prompts = [SimpleNamespace(messages=[{"role": "user", "content": i}]) for i in range(3)]
    same, other = {i: [i, 1, 2] for i in range(3)}, {0: [0, 1, 2], 1: [9], 2: [2, 1, 2]}
    engines = {"plain": _Arm("plain", log, same), "a": _Arm("a", log, same), "b": _Arm("b", log, other)}
    rows = run_interleaved(engines, prompts, None, repeats=2)
    # every arm's shared drafter state is reset before each repeat's first prompt, and only then
    resets = [j for j, (_, what) in enumerate(log) if what == "reset"]
    assert resets == [0, 1, 2, 12, 13, 14], log
    log = [x for x in log if x[1] != "reset"]
    firsts = [log[3 * j][0] for j in range(6)]  # the first arm of each (repeat, prompt)
    assert firsts == ["plain", "a", "b", "plain", "a", "b"]
    assert sorted(log) == sorted((n, i) for n in engines for i in range(3) for _ in range(2))
    assert [r.identical for r in rows["a"]] == [True] * 6
    assert [r.identical for r in rows["b"]] == [True, False, True] * 2
    assert [(r.repeat, r.prompt) for r in rows["b"]] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert rows["b"][1].tokens == 1 and rows["a"][0].drafted_per_step == pytest.approx(1.5)
    assert rows["a"][0].ttft == 0.25
    with pytest.raises(ValueError, match="baseline"):
        run_interleaved({"a": engines["a"]}, prompts, None, repeats=1)
    # each run's own steps and phase seconds, from the arm's step clock around its request
    assert [r.steps for r in rows["a"]] == [1, 2, 3] * 2
    assert rows["a"][2].phases == pytest.approx((3e-3, 6e-3, 9e-3, 12e-3))


def test_own_length_runs_each_prompt_to_its_own_max_tokens():
    from verispec import SamplingParams

    seen: list = []

    class _Len(_Arm):
        def chat(self, conversations, params, use_tqdm=False):
            seen.append((self.name, conversations[0][0]["content"], params.max_tokens, params.temperature))
            return super().chat(conversations, params, use_tqdm)

    log: list = []
    prompts = [SimpleNamespace(messages=[{"role": "user", "content": i}], max_tokens=m) for i, m in enumerate((5, 9))]
    toks = {i: [i] for i in range(2)}
    engines = {"plain": _Len("plain", log, toks), "a": _Len("a", log, toks)}
    params = SamplingParams(temperature=0, max_tokens=3)
    run_interleaved(engines, prompts, params, repeats=1, own_length=True)
    assert sorted(seen) == sorted((n, i, m, 0) for n in engines for i, m in enumerate((5, 9)))
    seen.clear()
    run_interleaved(engines, prompts, params, repeats=1)  # the given length for every prompt
    assert {m for *_, m, _ in seen} == {3}


def test_phase_row_is_ms_per_step_of_each_phase_and_the_rest():
    runs = [ArmRun(0, 0, 10, 0.050, 1, 0, True, steps=4, phases=(0.001, 0.002, 0.030, 0.005)),
            ArmRun(0, 1, 10, 0.070, 1, 0, True, steps=6, phases=(0.002, 0.000, 0.050, 0.008))]
    row = phase_row(runs)
    assert row["steps"] == 10
    assert row["schedule"] == pytest.approx(0.3) and row["draft"] == pytest.approx(0.2)
    assert row["forward"] == pytest.approx(8.0) and row["commit"] == pytest.approx(1.3)
    assert row["total"] == pytest.approx(12.0) and row["other"] == pytest.approx(12.0 - 9.8)
    assert phase_row([ArmRun(0, 0, 10, 1.0, 1, 0, True)]) is None  # no step clock


def test_pooled_and_per_prompt_ratios():
    # the arm: 10 tokens in 1 s and 30 in 1 s; the baseline: 10 in 2 s and 30 in 2 s (repeat 0), then all equal
    arm = [ArmRun(0, 0, 10, 1.0, 1, 0, True), ArmRun(0, 1, 30, 1.0, 1, 0, True), ArmRun(1, 0, 10, 1.0, 1, 0, True)]
    base = [ArmRun(0, 0, 10, 2.0, 1, 0, True), ArmRun(0, 1, 30, 2.0, 1, 0, True), ArmRun(1, 0, 10, 1.0, 1, 0, True)]
    assert pooled_ratios(arm, base, 2) == pytest.approx([(40 / 2) / (40 / 4), 1.0])
    assert per_prompt_ratios(arm, base) == pytest.approx([2.0, 2.0, 1.0])


def test_decode_only_ratio_leaves_the_prefill_out():
    # both arms spend 0.5 s on prefill; the arm decodes 10 tokens (9 after the first) in 0.5 s, the baseline in 1.5 s
    arm = [ArmRun(0, 0, 10, 1.0, 2, 1, True, ttft=0.5)]
    base = [ArmRun(0, 0, 10, 2.0, 1, 0, True, ttft=0.5)]
    assert pooled_ratios(arm, base, 1) == pytest.approx([2.0])  # whole requests: 10 / 1 s against 10 / 2 s
    assert pooled_ratios(arm, base, 1, decode=True) == pytest.approx([(9 / 0.5) / (9 / 1.5)])
