"""Which target hidden states the learned drafters read, and how to take them from a forward.

Layer indices name the hidden state ENTERING a target layer (HF's `hidden_states[i]`); index L (the number of
layers) is the last layer's output before the final norm. A drafter's feature row is the concatenation of its
layers' states at one position, in the order of its `feature_layers`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from verispec.models.llama import ForwardOutput, LlamaModel


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / mid / high aux layers (2, L//2, L-3), as vLLM and SGLang default them."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3)}))


def dflash_target_layer_ids(num_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's target_layer_ids: one per draft layer, spread evenly over [1, L-3] (layers whose OUTPUT is read)."""
    lo, hi = 1, max(1, num_layers - 3)
    if num_draft_layers == 1:
        return ((lo + hi) // 2,)
    return tuple(round(lo + i * (hi - lo) / (num_draft_layers - 1)) for i in range(num_draft_layers))


def dflash_layers(num_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The same layers as `feature_layers`: the output of layer i is the state entering layer i + 1."""
    return tuple(i + 1 for i in dflash_target_layer_ids(num_layers, num_draft_layers))


def select(hidden: Mapping[int, torch.Tensor], layers: Sequence[int], rows: slice | torch.Tensor | None = None
           ) -> torch.Tensor:
    """[n, len(layers) * d]: the captured states of `layers` (rows of the flat block), concatenated per position."""
    parts = [hidden[i] if rows is None else hidden[i][rows] for i in layers]
    return torch.cat(parts, dim=-1)


def take(out: ForwardOutput, layers: Sequence[int], rows: slice | torch.Tensor) -> torch.Tensor:
    """`select` from a forward's output: where the forward captured exactly `layers` side by side (`out.packed`),
    their rows of that buffer, with no concatenation (a view for a slice: copy what you keep); else select's."""
    if out.packed is not None and tuple(layers) == out.packed_layers:
        return out.packed[rows]
    return select(out.hidden, layers, rows)


def own(feats: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """feats as a drafter keeps them: the tensor itself where it is the whole of its storage (a fresh tensor, or a
    one-position step's capture buffer: keeping it holds nothing more alive), else a copy (a view of a bigger step's
    buffer would keep every row of that step alive while the drafter waits to use its own)."""
    dtype = feats.dtype if dtype is None else dtype
    if (feats.dtype is dtype and feats.device == device
            and feats.untyped_storage().nbytes() == feats.numel() * feats.element_size()):
        return feats
    return feats.to(device=device, dtype=dtype, copy=True)


def capture_forward(model: LlamaModel, tokens: Sequence[int], layers: Sequence[int]) -> ForwardOutput:
    """A from-scratch target forward over `tokens` in a fresh cache, capturing `layers` and the post-norm states."""
    _, _, out = model.prefill_fresh(tokens, logits_indices=[len(tokens) - 1], capture_layers=tuple(layers),
                                    return_last_hidden=True)
    return out


def capture_many(model: LlamaModel, sequences: Sequence[Sequence[int]], layers: Sequence[int],
                 max_tokens: int = 4096) -> list[tuple[dict[int, torch.Tensor], torch.Tensor]]:
    """Batched prefill, capture only: per sequence ({layer: [n, d]}, last_hidden [n, d]), each sequence in its own
    cache slot of one forward over up to `max_tokens` rows (a longer sequence runs alone)."""
    from verispec.models.llama import Segment

    out: list[tuple[dict[int, torch.Tensor], torch.Tensor]] = []
    i = 0
    while i < len(sequences):
        group = [sequences[i]]
        while i + len(group) < len(sequences) and sum(map(len, group)) + len(sequences[i + len(group)]) <= max_tokens:
            group.append(sequences[i + len(group)])
        cache = model.new_cache(max(map(len, group)), num_slots=len(group))
        segs = [Segment(cache.allocate(), 0, len(g)) for g in group]
        ids = torch.tensor([t for g in group for t in g], device=model.device)
        fwd = model(ids, segs, cache, logits_indices=[], capture_layers=tuple(layers), return_last_hidden=True)
        rows = 0
        for g in group:
            part = slice(rows, rows + len(g))
            out.append(({k: fwd.hidden[k][part] for k in layers}, fwd.last_hidden[part]))  # type: ignore[index]
            rows += len(g)
        i += len(group)
    return out


def target_features(model: LlamaModel, tokens: Sequence[int], layers: Sequence[int]) -> tuple[torch.Tensor, ForwardOutput]:
    """([n, len(layers) d] features from scratch, the forward output): the state oracle's reference."""
    out = capture_forward(model, tokens, layers)
    return select(out.hidden, layers), out
