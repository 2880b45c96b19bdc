"""The model runner: lays the blocks of one engine step out as ONE flat target forward and hands back each
block's rows.

Decode blocks come first (each [pending last token, draft x_1..x_g], logits for every row), then prefill
chunks (no logits). The forward reserves every block in the KV cache; the engine then commits what it keeps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from verispec.execution.features import take
from verispec.execution.thread_governor import ThreadGovernor
from verispec.kernels.threads import kernel_thread_count
from verispec.models.llama import ForwardOutput, LlamaModel, Segment
from verispec.state.kv_cache import KVCache


@dataclass(frozen=True)
class Block:
    """`tokens` of the sequence in cache slot `slot`, at positions start .. start + len(tokens) - 1."""

    slot: int
    start: int
    tokens: list[int]
    logits: bool  # a decode block: logits for every row
    tree: tuple[int, ...] | None = None  # a decode block that is a draft tree: its nodes' parent links


@dataclass
class BatchOutput:
    """The forward over the flat batch, addressed by block index."""

    out: ForwardOutput
    rows: list[slice]  # [block] its rows in the flat batch
    logit_rows: list[slice | None]  # [block] its rows among the logits (decode blocks only)
    feature_layers: tuple[int, ...]

    def logits(self, block: int) -> torch.Tensor:
        """[len(block), V] float32 logits of a decode block."""
        rows = self.logit_rows[block]
        assert rows is not None, "a prefill chunk has no logits"
        return self.out.logits[rows]

    def features(self, block: int, n: int | None = None, rows: Sequence[int] | None = None,
                 layers: Sequence[int] | None = None) -> torch.Tensor:
        """[n, len(layers) d]: the captured states of `layers` (default: the drafters' `feature_layers`) at the
        block's first n rows (all by default), or at the given rows of the block (a tree's root and accepted path).
        May be a view of the step's capture buffer: keep it through `execution.features.own`."""
        r = self.rows[block]
        layers = self.feature_layers if layers is None else layers
        if rows is not None:
            return take(self.out, layers, torch.tensor([r.start + i for i in rows]))
        stop = r.stop if n is None else r.start + n
        return take(self.out, layers, slice(r.start, stop))


class ModelRunner:
    """Runs the target over the blocks of one step; capturing `feature_layers` for learned drafters.

    threads: where given, the thread count of verispec's CPU kernel calls in each forward is the governor's choice
    (execution/thread_governor.py), timed and reported back. Only for the gguf-q8act path, whose forward is that
    kernel's calls and whose arithmetic does not depend on the thread count (it splits by output rows and heads,
    never along a sum; tests/test_thread_governor.py checks it), so that a step's tokens are the same whichever
    count ran it."""

    def __init__(self, model: LlamaModel, cache: KVCache, feature_layers: Sequence[int] = (),
                 threads: ThreadGovernor | None = None) -> None:
        self.model, self.cache, self.feature_layers = model, cache, tuple(feature_layers)
        self.threads = threads

    def run(self, blocks: Sequence[Block], record_layers: Sequence[int] = ()) -> BatchOutput:
        """record_layers: layers captured as well this step (requests that asked for their hidden states)."""
        ids: list[int] = []
        segments: list[Segment] = []
        logits_rows: list[int] = []
        rows: list[slice] = []
        logit_rows: list[slice | None] = []
        for b in blocks:
            n = len(b.tokens)
            rows.append(slice(len(ids), len(ids) + n))
            logit_rows.append(slice(len(logits_rows), len(logits_rows) + n) if b.logits else None)
            if b.logits:
                logits_rows.extend(range(len(ids), len(ids) + n))
            segments.append(Segment(b.slot, b.start, n, tree=b.tree))
            ids.extend(b.tokens)
        capture = tuple(sorted({*self.feature_layers, *record_layers})) if record_layers else self.feature_layers
        x = torch.tensor(ids, device=self.model.device)
        if self.threads is None:
            out = self.model(x, segments, self.cache, logits_indices=logits_rows, capture_layers=capture)
        else:
            n = self.threads.choose(len(ids))
            t0 = time.perf_counter()
            with kernel_thread_count(n):
                out = self.model(x, segments, self.cache, logits_indices=logits_rows, capture_layers=capture)
            self.threads.observe(len(ids), n, time.perf_counter() - t0)
        return BatchOutput(out, rows, logit_rows, self.feature_layers)
