"""Log-probabilities of emitted tokens, as vLLM returns them by default (`logprobs_mode="raw_logprobs"`): the
log_softmax of the target's raw logits, before temperature, top-k and top-p.

Row i of a decode block's verification logits is the distribution the i-th emitted token was verified or sampled
from (accepted drafts, then the recovered or bonus token), so plain and speculative decoding report the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from verispec.sampling import SamplingParams



class BlockLogits(Protocol):
    """What record_logprobs reads of a forward's output (execution/runner.py's BatchOutput)."""

    def logits(self, block: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class TokenLogprobs:
    """One emitted token under the target: its logprob and rank (1 = most likely; ties count as ranked above), and
    the `k` most likely tokens with theirs, in descending order (k = SamplingParams.logprobs)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Logprob:
    """vLLM's per-token entry of `CompletionOutput.logprobs`: {token_id: Logprob}."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """logits: [n, V] raw rows, tokens: the n tokens emitted from them -> one TokenLogprobs per token."""
    assert logits.shape[0] == len(tokens), f"{logits.shape[0]} logits rows for {len(tokens)} tokens"
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    ids = torch.tensor(tokens, device=logp.device).unsqueeze(-1)  # [n, 1]
    chosen = logp.gather(-1, ids)  # [n, 1]
    ranks = (logp >= chosen).sum(-1)  # [n]: vLLM counts ties as ranked above
    top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1) if k > 0 else None  # values, indices: [n, k]
    out = []
    for i, t in enumerate(tokens):
        top_ids = tuple(top.indices[i].tolist()) if top is not None else ()
        top_lps = tuple(top.values[i].tolist()) if top is not None else ()
        out.append(TokenLogprobs(int(t), float(chosen[i, 0]), int(ranks[i]), top_ids, top_lps))
    return out


class Recorded(Protocol):
    """What record_logprobs needs of a request (state/request.py's Request, which imports this module)."""

    params: SamplingParams
    output_ids: list[int]
    output_logprobs: list[TokenLogprobs]


def record_logprobs(req: Recorded, out: BlockLogits, block: int, kept: list[int], rows: list[int] | None = None
                    ) -> None:
    """After `req.append` kept `kept` (the first len(kept) tokens emitted from decode block `block`, whose logits
    row i the i-th was verified or sampled from; row rows[i] for a draft tree): store their logprobs on the request
    when it asked for them (params.logprobs is not None), aligned with output_ids."""
    k = req.params.logprobs
    if k is None or not kept:
        return
    logits = out.logits(block) if rows is None else out.logits(block)[rows]
    req.output_logprobs.extend(token_logprobs(logits[: len(kept)], kept, k))
    assert len(req.output_logprobs) == len(req.output_ids), "logprobs out of step with the output tokens"


def vllm_logprobs(entries: list[TokenLogprobs], decode: Callable[[list[int]], str] | None = None
                  ) -> list[dict[int, Logprob]]:
    """vLLM's layout: per token {sampled id: Logprob, then the top-k ids: Logprob} (k or k + 1 entries)."""
    def lp(tid: int, logprob: float, rank: int) -> Logprob:
        return Logprob(logprob, rank, decode([tid]) if decode is not None else None)

    out = []
    for e in entries:
        d = {e.token_id: lp(e.token_id, e.logprob, e.rank)}
        for r, (tid, v) in enumerate(zip(e.top_ids, e.top_logprobs), start=1):
            d.setdefault(tid, lp(tid, v, r))
        out.append(d)
    return out

