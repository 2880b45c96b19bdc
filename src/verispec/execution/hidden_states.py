"""The target's hidden states a request asked for (`SamplingParams.return_hidden_states`), recorded as the engine
commits positions: prefill chunks as they run, then each verified block's kept rows (the pending token and the
accepted drafts, or a tree's root and accepted path), so the rows are exactly what the forwards that produced the
output computed, in position order. The last output token is never fed to the target, so it has no row: a
request ends with len(prompt) + len(output) - 1 of them (fewer rows are kept when a stop string cut the output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from verispec.execution.features import own

if TYPE_CHECKING:
    from verispec.execution.runner import BatchOutput
    from verispec.state.request import Request


def check_layers(req: "Request", num_layers: int) -> None:
    """ValueError when the request asks for a layer the target does not have (index num_layers: its last output)."""
    bad = [i for i in req.params.return_hidden_states if i > num_layers]
    if bad:
        raise ValueError(f"return_hidden_states: layers {bad} are outside 0..{num_layers} (the index {num_layers} "
                         "is the last layer's output)")


def record_layers(reqs: Sequence["Request"]) -> tuple[int, ...]:
    """The layers a step must capture for these requests (their union)."""
    return tuple(sorted({i for r in reqs for i in r.params.return_hidden_states}))


def record_hidden_states(req: "Request", out: "BatchOutput", block: int, n: int | None = None,
                         rows: Sequence[int] | None = None) -> None:
    """Keep block `block`'s committed rows (its first n, or the given tree rows) when the request asked for them."""
    layers = req.params.return_hidden_states
    if layers:
        feats = out.features(block, n, rows, layers=layers)  # [n, len(layers) d]
        req.hidden_rows.append(own(feats, feats.device))


def hidden_states(req: "Request", hidden_size: int) -> dict[int, torch.Tensor] | None:
    """{layer: [len(prompt) + len(output) - 1, d]} for a finished request that asked, else None."""
    layers = req.params.return_hidden_states
    if not layers:
        return None
    n = len(req.all_ids) - 1
    flat = torch.cat(req.hidden_rows)[:n] if req.hidden_rows else torch.zeros(0, len(layers) * hidden_size)
    assert flat.shape == (n, len(layers) * hidden_size), \
        f"{req.request_id}: recorded {tuple(flat.shape)} hidden rows for {n} fed positions"
    return {i: flat[:, k * hidden_size : (k + 1) * hidden_size] for k, i in enumerate(layers)}
