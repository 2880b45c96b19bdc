"""Sampling parameters (vLLM's names), the seeded generators of a request's random streams, and the pure function
that turns logits into the distribution tokens are drawn from.

The same `target_probs` is used by plain decoding and, later, by speculative verification, so both sample from
exactly the same processed distribution (temperature, then top-k, then top-p).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 to disable, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (as in vLLM): dividing logits by them overflows to NaN."""
        return self.temperature < GREEDY_EPS

    def make_generator(self, device: torch.device | str = "cpu", stream: str = "target") -> torch.Generator:
        """The generator of one of this request's random streams: seeded with seed + GENERATOR_STREAMS[stream]
        (so seeded outputs are reproducible and a drafter never consumes the target's draws), random when
        seed is None."""
        if stream not in GENERATOR_STREAMS:
            raise ValueError(f"unknown generator stream {stream!r}; known: {', '.join(GENERATOR_STREAMS)}")
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed + GENERATOR_STREAMS[stream])
        return g


# The offset of each sampler's stream from the request's seed: the target's sampler and verifier, and each drafter
# that samples (DSpark uses DFlash's drafter). Fixed: changing one changes every seeded sampled output.
GENERATOR_STREAMS = {"target": 0, "draft_model": 1, "dflash": 1, "eagle3": 2}


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits: [M, V] -> probabilities [M, V] (float32) after temperature, top-k and top-p.

    temperature must be > 0 here; greedy decoding takes the argmax of the raw logits instead.
    """
    assert temperature > 0, "greedy decoding does not build a distribution"
    x = logits.float() / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # [M, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [M, V]
        sorted_p = sorted_x.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)
