"""Engine-wide counters the server publishes on /metrics: speculative acceptance (vLLM's spec_decode_* metrics)
and where the engine's steps spend their time, by phase. Plain numbers: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

# the phases of a step (engine/core.py `Engine.step`), in order
PHASES = ("schedule", "draft", "forward", "commit")


@dataclass(frozen=True)
class StepTiming:
    """Seconds of one step that every decoding request in it shares."""

    sched_s: float  # planning and policy decisions (drafting excluded)
    forward_s: float  # the batched target forward


@dataclass
class SpecCounters:
    """Engine-wide speculative counters (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


@dataclass
class StepClock:
    """Steps that ran a forward, the rows they fed it, and their seconds summed per phase:
    schedule - reaping, admission (and preemption), planning and the policy's decisions;
    draft    - the drafters proposing;
    forward  - the batched target forward;
    commit   - prefill KV, verification, committing accepted positions, emitting tokens, reaping finished ones.
    A serving benchmark reads the deltas over a level: time per step, and which phase two servers differ in."""

    steps: int = 0
    forward_tokens: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def record(self, tokens: int, **seconds: float) -> None:
        assert set(seconds) == set(PHASES) and min(seconds.values()) >= 0.0, seconds
        self.steps += 1
        self.forward_tokens += tokens
        for phase, s in seconds.items():
            self.seconds[phase] += s
