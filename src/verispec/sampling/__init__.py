"""Sampling parameters (vLLM's names), the seeded generators of a request's random streams, and the pure function
that turns logits into the distribution tokens are drawn from.

The same `target_probs` is used by plain decoding and by speculative verification, so both sample from exactly the
same processed distribution (temperature, then top-k, then top-p). A seeded request's tokens are drawn by the
exponential race over per-position noise (`coupled.py`), so they do not depend on speculation; an unseeded
request's by `sample_rows` from its generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from verispec.sampling import coupled
from verispec.sampling.coupled import race_index, race_rows


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
    # stop strings (a str or a list is taken): the output ends where its text first contains one (engine/stops.py)
    stop: tuple[str, ...] = field(default=())
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    logprobs: int | None = None  # vLLM's: return each output token's logprob and the top-N (0 = the token only)
    # the target's hidden state entering each of these layers (index L: the last layer's output, before the final
    # norm) at every position of prompt + output but the last, as the forwards computed it (SGLang's
    # return_hidden_states, per layer): RequestOutput.hidden_states; the self-distillation data of the drafters
    return_hidden_states: tuple[int, ...] = field(default=())
    # vLLM's controls on the target's logits (sampling/controls.py), applied per position under speculation too
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: tuple[str, ...] = field(default=())
    # vLLM's StructuredOutputsParams (or a dict of its fields): json / regex / choice / grammar / json_object
    structured_outputs: Any = None

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
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError("include_stop_str_in_output must be True or False, got "
                             f"{self.include_stop_str_in_output!r}")

        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0 (top logprobs per token), got {self.logprobs!r}")
        layers = self.return_hidden_states
        if isinstance(layers, (bool, int, str)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                            for i in layers):
            raise ValueError("return_hidden_states takes the target layer indices whose entering hidden state to "
                             f"return (a list of integers >= 0), got {layers!r}")
        object.__setattr__(self, "return_hidden_states", tuple(sorted(set(layers))))
        from verispec.sampling.controls import check_controls
        from verispec.sampling.grammar import StructuredOutputsParams

        bias, words = check_controls(self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                                     self.logit_bias, self.min_tokens, self.bad_words)
        object.__setattr__(self, "logit_bias", bias or None)
        object.__setattr__(self, "bad_words", words)
        object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_any(self.structured_outputs))

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

    def draft_sampler(self, device: torch.device | str, stream: str) -> "DraftSampler":
        """A sampling drafter's draws (None generator when greedy): coupled to the target's position noise when the
        request is seeded (and `coupled.COUPLE_DRAFTS`), else from the drafter's own stream."""
        gen = None if self.greedy else self.make_generator(device, stream)
        couple = gen is not None and self.seed is not None and coupled.COUPLE_DRAFTS
        return DraftSampler(gen, self.seed if couple else None)


# The offset of each sampler's stream from the request's seed: the target's sampler and verifier, and each drafter
# that samples (DSpark uses DFlash's drafter). Fixed: changing one changes every seeded sampled output.
GENERATOR_STREAMS = {"target": 0, "draft_model": 1, "dflash": 1, "eagle3": 2, "mtp": 3}


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
        # drop a token when the tokens ranked above it already reach top_p; the first token always stays, also
        # when top_p rounds to 0 in float32 (e.g. 1e-300), where the comparison alone would drop every token
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """[..., V] -> the index of each row's largest value (the first of equals, as torch's), flattened to a list.
    A float32 CPU tensor goes through numpy: torch's CPU argmax over a 49,152-token vocabulary costs ~0.1 ms per
    row on a 2-core machine (~1.5 ms for a verify block of 8), numpy's ~10 us; the greedy path takes one per step."""
    if logits.device.type == "cpu" and logits.dtype is torch.float32 and not logits.requires_grad:
        return logits.detach().numpy().argmax(-1).reshape(-1).tolist()
    return logits.argmax(-1).reshape(-1).tolist()


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """[..., V] probabilities (rows need not sum to exactly 1) -> one index per row drawn from that row, by the
    inverse CDF: one float64 uniform per row from `generator`, located in the row's float64 running sum.
    A zero-probability index is never drawn (its running sum equals its predecessor's). torch.multinomial(p, 1)
    costs ~1.3 ms for a 49,152-token row on a 2-core CPU (an exponential variate per token); this ~0.1 ms."""
    rows = probs.reshape(-1, probs.shape[-1])  # [M, V]
    cdf = rows.double().cumsum(-1)  # [M, V]
    u = torch.rand(rows.shape[0], 1, dtype=torch.float64, generator=generator, device=rows.device)  # [M, 1]
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [M, 1] first index whose running sum passes u
    return idx.clamp_max(rows.shape[-1] - 1).reshape(-1).tolist()


def sample_index(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """[V] probabilities -> one index drawn from them (`sample_rows` of one row)."""
    return sample_rows(p[None], generator)[0]


@dataclass
class DraftSampler:
    """A sampling drafter's draws for one request: coupled (the target's position noise on the drafter's q) when
    the request is seeded and `coupled`, else from its own generator (the Leviathan rule's independent draft)."""

    generator: torch.Generator | None
    seed: int | None = None  # set: coupled draws

    @property
    def coupled(self) -> bool:
        return self.seed is not None

    def index(self, q: torch.Tensor, position: int) -> int:
        """A token drawn from q [V] for absolute position `position`."""
        return sample_index(q, self.generator) if self.seed is None else race_index(q, self.seed, position)

    def rows(self, q: torch.Tensor, first_position: int) -> list[int]:
        """[M, V] -> one token per row, row j at position first_position + j."""
        return sample_rows(q, self.generator) if self.seed is None else race_rows(q, self.seed, first_position)

    def among(self, q: torch.Tensor, ids: torch.Tensor, position: int) -> int:
        """An index into q [m], a distribution over the token ids `ids` [m], for `position`."""
        return sample_index(q, self.generator) if self.seed is None else race_index(q, self.seed, position, ids)
