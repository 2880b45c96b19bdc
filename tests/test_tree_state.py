"""After a forward over a draft tree, only the accepted path's K/V survive, moved into place: the cache then holds
what a prefill of the context and that path computes, and the next token's logits equal HF transformers' on the
whole sequence. Keeping a rejected sibling's K/V instead (the negative control) is caught by both checks."""

from __future__ import annotations

import pytest
import torch

from tests.test_tree_attention import CTX_A, PARENTS, models  # noqa: F401 - the fixture
from verispec.models.llama import Segment
from verispec.models.tree import path_to

ACCEPTED = path_to(PARENTS, 7)  # nodes 0, 2, 5, 7 (depth 4): the deepest path; node 1 is a rejected sibling of 0


def _tree_step(model, kind: str, rows_of_path):
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, 97, (CTX_A,), generator=g)
    tree = torch.randint(0, 97, (1 + len(PARENTS),), generator=g)
    bonus = torch.randint(0, 97, (1,), generator=g)
    if kind == "slots":
        cache = model.new_cache(64, num_slots=2)
    else:
        cache = model.new_paged_cache(64, num_blocks=24, block_size=4, num_slots=2)
    slot, other = cache.allocate(), cache.allocate()
    model.prefill(ctx, cache, slot)
    model.prefill(ctx[:5], cache, other)  # the paged tree block lands after another sequence's blocks
    model(tree, [Segment(slot, CTX_A, len(tree), tree=PARENTS)], cache, logits_indices=range(len(tree)))
    cache.commit_rows(slot, rows_of_path)
    kept = torch.cat([ctx, tree[[0] + [1 + n for n in ACCEPTED]]])  # what the cache must now hold
    out = model(bonus, [Segment(slot, len(kept), 1)], cache)  # the next step: the bonus token after the path
    cache.commit(slot, 1)
    return cache, slot, torch.cat([kept, bonus]), out.logits[0]


def _cache_matches_prefill(model, cache, slot, ids) -> bool:
    ref = model.new_cache(64)
    model.prefill(ids, ref, ref.allocate())
    return all(torch.allclose(cache.read(li, slot, len(ids))[0], ref.read(li, 0, len(ids))[0], atol=1e-5)
               and torch.allclose(cache.read(li, slot, len(ids))[1], ref.read(li, 0, len(ids))[1], atol=1e-5)
               for li in range(model.cfg.num_layers))


@pytest.mark.parametrize("kind", ["slots", "paged"])
@pytest.mark.parametrize("name", ["llama", "mistral-window"])
def test_the_accepted_path_is_moved_into_place(models, name, kind):  # noqa: F811
    hf, ours = models[name]
    ours.batch_invariant = False
    cache, slot, ids, logits = _tree_step(ours, kind, [0] + [1 + n for n in ACCEPTED])
    assert cache.length(slot) == len(ids) == CTX_A + 1 + len(ACCEPTED) + 1
    assert _cache_matches_prefill(ours, cache, slot, ids)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1]
    assert (logits - ref).abs().max().item() <= 1e-4
    if kind == "paged":
        cache.check()


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_negative_control_a_rejected_siblings_kv_is_caught(models, kind):  # noqa: F811
    hf, ours = models["llama"]
    ours.batch_invariant = False
    assert ACCEPTED[0] == 0 and PARENTS[1] == PARENTS[0]
    wrong = [0, 1 + 1] + [1 + n for n in ACCEPTED[1:]]  # node 1's row where node 0's belongs
    cache, slot, ids, logits = _tree_step(ours, kind, wrong)
    assert not _cache_matches_prefill(ours, cache, slot, ids)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1]
    assert (logits - ref).abs().max().item() > 1e-3
