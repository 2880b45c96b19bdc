"""A DFlash / DSpark drafter's draft vocabulary, for inference only: the target tokens it may propose, the most
frequent response tokens of its training data (`verispec train draft-vocab`), kept beside the checkpoint as
`draft_vocab.safetensors` ("ids": ascending target ids).

With one, a block's logits go through the output matrix's rows of those tokens only (and DSpark's Markov W2 rows
likewise): on the default model 16,384 of 49,152 rows, a third of the head's bytes and arithmetic per draft row.
The logits handed on keep the target's vocabulary, -inf at every other token, so greedy picks, sampling (the draft
distribution is zero there: rejection sampling stays exact) and trees work unchanged. Training, exports and `train
selector` never use it (a checkpoint saved by them keeps the file it came with).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

FILE = "draft_vocab.safetensors"


def check(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids as a draft vocabulary: 1-D, ascending, distinct target ids; refused otherwise."""
    ids = torch.as_tensor(ids).long().flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"a draft vocabulary needs target ids in 0..{vocab_size - 1}, got {ids.numel()} ids")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("a draft vocabulary's ids must be ascending and distinct")
    return ids


def read(directory: str | Path) -> torch.Tensor | None:
    """The ids stored beside a checkpoint, or None."""
    from safetensors.torch import load_file

    p = Path(directory) / FILE
    return load_file(str(p))["ids"] if p.is_file() else None


def write(directory: str | Path, ids: torch.Tensor, vocab_size: int) -> Path:
    from safetensors.torch import save_file

    p = Path(directory) / FILE
    save_file({"ids": check(ids, vocab_size).contiguous()}, str(p))
    return p


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent tokens of counts [V] (ties: lower id, so unseen tokens pad in id order),
    ascending."""
    return torch.sort(-counts, stable=True).indices[:size].sort().values


class DraftVocab:
    """The rows of the output matrix (and of DSpark's W2) for `ids`, as Q8_0 blocks on verispec's kernel beside a
    gguf-q8act target (`kernel`), else dense in the drafter's dtype."""

    def __init__(self, ids: torch.Tensor, out_rows: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                 w2: torch.Tensor | None, kernel: bool) -> None:
        """out_rows: ids [n] -> [n, d] rows of the target's output matrix (dflash_model.TargetParts.out_rows: no
        dense table where the head is tied to a GGUF embedding)."""
        ids = check(ids, vocab_size)
        head = out_rows(ids)
        self.ids = ids.to(head.device)
        self.vocab_size = vocab_size
        self.kernel = kernel
        w2r = None if w2 is None else w2.detach()[self.ids]
        self.head, self.w2 = head, w2r  # dense rows; DSpark's W2 [Vd, r] (models/linear.py's Weight)
        if kernel:
            from verispec.kernels.q8act import Q8ActWeight

            self.head = Q8ActWeight.from_float(head.float().contiguous())
            if w2r is not None and w2r.shape[1] % 32 == 0:  # Q8_0 blocks are 32 wide, as DFlashModel rounds W2
                self.w2 = Q8ActWeight.from_float(w2r.float().contiguous())

    def small_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [n, d] -> [n, Vd] float32: the draft tokens' logits, in the order of `ids`."""
        if self.kernel:
            return self.head.matmul(h.float().contiguous())
        return F.linear(h, self.head.to(h.dtype)).float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [n, d] -> [n, V] float32: the draft tokens' logits, -inf at every other token."""
        out = torch.full((h.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32, device=h.device)
        return out.index_copy_(1, self.ids, self.small_logits(h))
