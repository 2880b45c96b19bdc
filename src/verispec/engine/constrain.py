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
    """The request's draft this step: `lv.propose(k, floor)`, or for a request with a processor the grammar's
    forced tokens (up to `limit`, whatever k the policy chose before drafting: they are certain), else the
    drafter's chain cut where the grammar forbids a token. Requests with a processor draft chains only."""
    proc = lv.proc
    lv.forced = 0
    if proc is None:
        return lv.propose(k, floor)
    lv.tree_now = False
    forced = proc.forced(limit)
    if forced:
        lv.forced = len(forced)
        return Draft(forced, confidence=[1.0] * len(forced))
    d = lv.propose(k, floor)
    if not d.tokens:
        return d
    n = proc.cut(d.tokens)
    return d.head(n) if n else EMPTY


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
    """Whether this step's verdict speaks of the drafter (not where the draft was the grammar's forced tokens)."""
    return lv.drafter is not None and not lv.forced


def check_state(lv: "LiveRequest", processors: "ProcessorFactory | None") -> None:
    """The state oracle's grammar part (`check_state`): the live matcher against one fed the committed output."""
    if lv.proc is None or lv.proc.matcher is None or processors is None:
        return
    spec = lv.req.params.structured_outputs
    check_matcher(lv.proc.matcher, lv.req.output_ids, lambda: processors.compiler.matcher(spec))
