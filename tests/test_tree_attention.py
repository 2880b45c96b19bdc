"""One forward over a draft tree: every node's logits equal HF transformers' logits for the context followed by that
node's root path (tiny random configs, fp32), beside a chain of another sequence in the same forward, on the
default and the per-query attention paths, in the slot cache and the paged cache (whose blocks are not consecutive
here), with and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from verispec.models.llama import Segment
from verispec.models.loader import load_model
from verispec.models.tree import path_to

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
PARENTS = (-1, -1, 0, 0, 1, 2, 4, 5)  # 8 nodes, depth 4: two branches below the root, ragged below them
CTX_A, CTX_B = 11, 9  # prompt lengths of the two sequences


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    return {
        "llama": LlamaConfig(**COMMON, rope_theta=5000.0),
        "mistral-window": MistralConfig(**COMMON, sliding_window=7),
        "qwen3": Qwen3Config(**COMMON, head_dim=24),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = {}
    for name, cfg in _configs().items():
        torch.manual_seed(7)
        cfg._attn_implementation = "eager"
        hf = AutoModelForCausalLM.from_config(cfg).eval()
        d = tmp_path_factory.mktemp(name)
        hf.save_pretrained(d)
        ours, _ = load_model(str(d), dtype="float32")
        out[name] = (hf, ours)
    return out


def _cache(model, kind: str):
    if kind == "slots":
        return model.new_cache(64, num_slots=2)
    return model.new_paged_cache(64, num_blocks=24, block_size=4, num_slots=2)


@pytest.mark.parametrize("kind", ["slots", "paged"])
@pytest.mark.parametrize("per_query", [False, True], ids=["default", "per-query"])
@pytest.mark.parametrize("name", ["llama", "mistral-window", "qwen3"])
def test_tree_rows_equal_their_root_paths(models, name, per_query, kind):
    hf, ours = models[name]
    ours.batch_invariant = per_query
    g = torch.Generator().manual_seed(1)
    ctx_a, ctx_b = torch.randint(0, 97, (CTX_A,), generator=g), torch.randint(0, 97, (CTX_B,), generator=g)
    tree = torch.randint(0, 97, (1 + len(PARENTS),), generator=g)  # the root (pending token), then the nodes
    chain = torch.randint(0, 97, (3,), generator=g)
    cache = _cache(ours, kind)
    a, b = cache.allocate(), cache.allocate()
    ours.prefill(ctx_a, cache, a)
    ours.prefill(ctx_b, cache, b)  # in the paged cache, b's blocks now lie between a's context and a's tree
    segments = [Segment(a, CTX_A, len(tree), tree=PARENTS), Segment(b, CTX_B, len(chain))]
    out = ours(torch.cat([tree, chain]), segments, cache, logits_indices=range(len(tree) + len(chain)))
    with torch.no_grad():
        for row in range(len(tree)):
            path = [0] + [1 + n for n in path_to(PARENTS, row - 1)]  # the root, then the nodes down to this row
            ref = hf(torch.cat([ctx_a, tree[path]])[None]).logits[0, -1]
            assert (out.logits[row] - ref).abs().max().item() <= 1e-4, (row, path)
        ref_chain = hf(torch.cat([ctx_b, chain])[None]).logits[0, CTX_B:]
    assert (out.logits[len(tree):] - ref_chain).abs().max().item() <= 1e-4


def test_a_window_shorter_than_the_tree_is_refused(models):
    _, ours = models["mistral-window"]
    cache = ours.new_cache(64)
    slot = cache.allocate()
    ours.prefill(torch.arange(5), cache, slot)
    deep = tuple(range(-1, 7))  # a chain-shaped tree of depth 8 > window 7
    with pytest.raises(AssertionError, match="window"):
        ours(torch.arange(9), [Segment(slot, 5, 9, tree=deep)], cache)
