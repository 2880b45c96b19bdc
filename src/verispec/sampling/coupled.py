"""Seeded sampling that does not depend on speculation: per-position noise keyed by (seed, position), and the
exponential race that turns a distribution and that noise into a token.

Why. With the Leviathan / Chen rule a seeded request's output depends on what was drafted: the uniforms are
spent per verified position and the recovered token comes from a residual that depends on the draft, so the same
seed gave different text alone, in a batch, streamed or not (the scheduler decides how much is drafted). Here the
token at absolute position i (its index in prompt + output) is

    x_i = argmax_x p_i(x) / E_i(x),   E_i(x) ~ Exp(1) i.i.d., drawn from a generator seeded by (seed, i),

the exponential race (Gumbel-max in another form: argmax log p + Gumbel). x_i is exactly a draw from p_i, the
request's processed distribution (temperature, top-k, top-p: `target_probs`), and it is a function of p_i and the
noise alone. Verification under this rule (execution/verify.py, tree_verify.py) accepts a drafted token iff it equals
x_i and otherwise emits x_i, so every output token is what plain seeded decoding emits with the same noise, whatever
was drafted, whatever else was in the batch: seeded speculative output == seeded plain output, given logits that
are bitwise the same alone and in a verify block (batch invariance). The seed of choice j of `n` is seed + j (as in
vLLM), so its noise differs from choice 0's.

Coupled drafting. A drafter that samples (draft model, EAGLE-3, DFlash, DSpark, MTP) draws its token at position
i with the same noise from its own q_i: argmax q_i / E_i (`DraftSampler`, in sampling/__init__.py). That draft is still an exact draw from q
(the noise is independent of q), and it equals the target's token with probability >= (1 - TV) / (1 + TV)
(Daliri et al. 2024, "Coupling without communication and drafter-invariant speculative decoding"), where
independent noise would give sum_x p(x) q(x). Tree children are the top-m of q / E (Gumbel top-k: distinct, the
first the coupled draw, the rest a draw without replacement). Deterministic drafts (n-gram, suffix) are accepted
with probability p(x) under either rule.

Unseeded requests keep the Leviathan rule (verify.py): its acceptance 1 - TV is the best any rule reaches for a
draft drawn from q, and it needs one uniform per position where the race needs a vocabulary of exponentials.
Lossy acceptance rules also keep it (they accept drafts the target would not have drawn: their output depends on
the draft by design).
"""

from __future__ import annotations

from collections import OrderedDict
from threading import Lock

import numpy as np
import torch

SEED_SPACE = 2**64  # seeds are taken modulo 2^64, as torch.manual_seed takes them
NOISE_TAG = 0x5EED_0F_70CE  # a fixed first word of the key: this noise never repeats another seeded stream
CACHE_ENTRIES = 256  # noise vectors kept (each vocab float32s): a batch's verify blocks and their drafters share them
TINY = np.float32(1e-30)
# seeded drafters draw with the target's position noise; False: from their own stream (measurements only)
COUPLE_DRAFTS = True  # an exponential of exactly 0 would divide a zero probability by zero


class _NoiseCache:
    """The latest CACHE_ENTRIES noise vectors by (seed, position, vocab): a position's noise is drawn once for the
    drafter and the verifier, and once more only when a rejected position is verified again past the cache."""

    def __init__(self) -> None:
        self._rows: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()
        self._lock = Lock()

    def get(self, seed: int, position: int, vocab: int) -> np.ndarray:
        key = (seed % SEED_SPACE, position, vocab)
        with self._lock:
            row = self._rows.get(key)
            if row is not None:
                self._rows.move_to_end(key)
                return row
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([NOISE_TAG, key[0], position])))
        row = rng.standard_exponential(vocab, dtype=np.float32)  # [V]
        np.maximum(row, TINY, out=row)
        row.flags.writeable = False
        with self._lock:
            self._rows[key] = row
            while len(self._rows) > CACHE_ENTRIES:
                self._rows.popitem(last=False)
        return row


_CACHE = _NoiseCache()


def position_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """[vocab] float32 Exp(1) variates of absolute position `position` of a request seeded `seed` (read-only)."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return _CACHE.get(seed, position, vocab)


def _ratios(p: torch.Tensor, noise: np.ndarray) -> np.ndarray:
    """p [V] / noise [V] as a float32 numpy row (p on any device; zero probabilities stay 0)."""
    row = p.detach().float().cpu().numpy()
    return row / noise


def race_index(p: torch.Tensor, seed: int, position: int, ids: torch.Tensor | None = None) -> int:
    """One token: argmax p / E over [V] (`ids`: p is over these token ids only, e.g. a selector's candidates; the
    answer is then an index into p). Exactly a draw from p (normalised); zero-probability entries never win."""
    if ids is None:
        noise = position_noise(seed, position, p.shape[-1])
    else:
        vocab = int(ids.max()) + 1
        noise = position_noise(seed, position, max(vocab, 1))[ids.detach().cpu().numpy()]
    return int(_ratios(p, noise).argmax())


def race_rows(probs: torch.Tensor, seed: int, first_position: int) -> list[int]:
    """[M, V] -> row j's race token at position first_position + j."""
    return [race_index(row, seed, first_position + j) for j, row in enumerate(probs)]


def race_top(q: torch.Tensor, m: int, seed: int, position: int) -> list[int]:
    """Up to m distinct tokens with the largest q / E at `position`, largest first (Gumbel top-k): the first is
    `race_index`, together a draw of m without replacement from q; fewer where q has fewer nonzero entries."""
    r = _ratios(q, position_noise(seed, position, q.shape[-1]))
    m = min(m, int((r > 0).sum()))
    if m <= 0:
        return []
    top = np.argpartition(-r, m - 1)[:m] if m < r.shape[0] else np.arange(r.shape[0])
    return top[np.argsort(-r[top], kind="stable")].tolist()
