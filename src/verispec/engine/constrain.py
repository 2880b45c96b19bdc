"""The engine's side of structured outputs and sampling controls: which requests carry a `RequestProcessor`
(sampling/processor.py), their drafts (the grammar's forced tokens first, the drafter's cut at the first token the
grammar forbids), their verified logits and their commits.

Forced tokens are free drafts (jump-forward inside speculation): where the grammar forces the next tokens, they are
the step's draft with confidence 1, so a policy that admits by survival (dspark) verifies them as certain, and the
drafter is not asked. The verification rule then checks them like any draft against the processed logits, so the
output is the constrained target's either way. Forced drafts are not the drafter's: its acceptance estimate does not
learn from them (`learns`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verispec.check.state import check_matcher
from verispec.drafters.base import EMPTY, Draft

if TYPE_CHECKING:
    from verispec.engine.plan import LiveRequest
    from verispec.sampling.processor import ProcessorFactory


def propose(lv: "LiveRequest", k: int, floor: float, limit: int) -> Draft:
    """The request's draft this step: `lv.propose(k, floor)`, or for a request with a processor, drafted through
    the grammar: the tokens it forces next (up to `limit`, whatever k the policy chose before drafting: they are
    certain), then the drafter's chain continuing them (up to k; from a drafter that `reads_context_only`, the
    others draft only where nothing is forced), cut where the grammar forbids a token, then the tokens the grammar
    forces after that chain (as likely to survive as its last token). A JSON answer's keys and separators are
    forced, so one step can verify a value the drafter guessed and the next key with it. Requests with a
    processor draft chains only."""
    proc = lv.proc
    lv.forced = lv.forced_tail = 0
    if proc is None:
        return lv.propose(k, floor)
    lv.tree_now = False
    forced = proc.forced(limit)
    lv.forced = len(forced)
    room = min(k, limit - len(forced))
    if forced and not getattr(lv.drafter, "reads_context_only", False):
        room = 0
    d = lv.propose(room, floor, after=forced) if room > 0 else EMPTY
    n = proc.cut(forced + d.tokens) - len(forced) if d.tokens else 0
    only_forced = Draft(forced, confidence=[1.0] * len(forced)) if forced else EMPTY
    if n <= 0 or (forced and d.probs is not None):
        return only_forced
    chain = d.head(n)
    if chain.probs is not None:  # drafted from q: verified with its q, nothing appended
        return chain
    after = proc.forced_after(forced + chain.tokens, limit - len(forced) - n)
    lv.forced_tail = len(after)
    conf = list(chain.confidence) if chain.confidence is not None else [1.0] * n
    return Draft(forced + chain.tokens + after, confidence=[1.0] * len(forced) + conf + [conf[-1]] * len(after))


def process(lv: "LiveRequest", logits: torch.Tensor) -> torch.Tensor:
    """The block's raw logits -> what the verification rule reads: processed row by row where the request has a
    processor, unchanged otherwise."""
    if lv.proc is None:
        return logits
    return lv.proc.process(logits, lv.req.output_ids, lv.draft.tokens)


def commit(lv: "LiveRequest", kept: list[int]) -> None:
    """The tokens appended to the output this step go into the matcher."""
    if lv.proc is not None and kept:
        lv.proc.commit(kept)


def learns(lv: "LiveRequest") -> bool:
    """Whether this step's verdict speaks of the drafter: not where the draft began with the grammar's forced
    tokens (its tokens after them were drafted on a context the estimate does not describe); a forced tail is
    left out by `LiveRequest.learn`."""
    return lv.drafter is not None and not lv.forced


def check_state(lv: "LiveRequest", processors: "ProcessorFactory | None") -> None:
    """The state oracle's grammar part (`check_state`): the live matcher against one fed the committed output."""
    if lv.proc is None or lv.proc.matcher is None or processors is None:
        return
    spec = lv.req.params.structured_outputs
    check_matcher(lv.proc.matcher, lv.req.output_ids, lambda: processors.compiler.matcher(spec))
