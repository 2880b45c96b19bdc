"""Replaying a drafter over a recorded continuation through the engine's own greedy verification rules: how many
steps it would take, without running the target again (the studies of chains against trees use it)."""

from __future__ import annotations

import torch

from verispec.drafters.dflash import DFlashDrafter
from verispec.execution.tree_verify import verify_tree_greedy
from verispec.execution.verify import verify_greedy
from verispec.models.tree import TreeDraft, depths


def replay(drafter, prompt: list[int], out: list[int], k: int, tree: bool, feats: torch.Tensor | None = None,
           width: int | None = None, start: int = 0, log: list[tuple[int, int, int]] | None = None
           ) -> tuple[int, int, int]:
    """(tokens committed, steps, positions verified) of n-gram drafting over the recorded continuation `out`,
    through the engine's own greedy verification rules, with logits whose argmax at every query row is the
    target's recorded next token for that row's depth (the only rows the rules read lie on the followed path).
    `start`: tokens of `out` committed before the first step (1: the prefill's token, where an engine's steps
    begin; the tokens committed then count from there). `log`: where given, each step's (position in `out` it
    starts at, tokens drafted, drafts accepted) is appended."""
    t, steps, verified = start, 0, 0
    end = out + [0] * (k + 1)  # past the continuation's end nothing matters: the replay stops there
    while t < len(out):
        context = prompt + out[:t]
        if feats is not None:  # a learned drafter: the target's features of every committed position but the last
            fed = drafter.n if isinstance(drafter, DFlashDrafter) else drafter.n_feat
            drafter.add_features(feats[fed : len(context) - 1])
        if not tree:
            d = TreeDraft.chain(drafter.propose(context, k).tokens)
        else:  # width: nodes expanded per depth, for the drafters that grow EAGLE-2's tree (eagle3)
            d = drafter.propose_tree(context, k, k) if width is None else drafter.propose_tree(context, k, k, width)
        rows = [t + r for r in depths(d.parents)]  # [N + 1] position in `out` each query row predicts
        logits = torch.zeros(len(rows), max(end[: t + k + 1] + list(d.tokens)) + 1)
        logits[torch.arange(len(rows)), torch.tensor([end[r] for r in rows])] = 1.0
        verdict = verify_tree_greedy(d, logits) if tree else verify_greedy(torch.tensor(d.tokens), logits)
        if log is not None:
            log.append((t, len(d.tokens), verdict.accepted))
        t += verdict.accepted + 1
        steps += 1
        verified += len(d.tokens) + 1
    drafter.release(prompt + out)  # the whole output (a suffix drafter leaves it in the shared cache)
    return len(out) - start, steps, verified


def engine_counts(drafter, prompt: list[int], out: list[int], k: int, feats: torch.Tensor | None = None
                  ) -> tuple[int, int]:
    """(drafts, accepted) of a chain drafter replayed over `out` as an engine's speculative counters count them
    (vLLM's num_drafts and num_accepted_tokens; llama-server's spec_decode counters): steps begin after the
    prefill's token, a draft is capped at the tokens left, a step with no draft (no room, or none proposed)
    is not one."""
    log: list[tuple[int, int, int]] = []
    replay(drafter, prompt, out, k, False, feats, start=1, log=log)
    drafts = accepted = 0
    for t, n, a in log:
        left = min(n, len(out) - 1 - t)
        drafts, accepted = drafts + (left > 0), accepted + min(a, left)
    return drafts, accepted
