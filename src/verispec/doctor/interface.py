"""The target's hidden-state interface a learned drafter relies on, checked from configs and tensors (pure).

`DrafterFacts` is what a drafter checkpoint says about the target it reads (layer ids, hidden size, vocabulary,
RoPE); each check compares one of them with the target's `ModelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from verispec.config import ModelConfig
from verispec.doctor.checks import Check, failed, passed


@dataclass(frozen=True)
class DrafterFacts:
    feature_layers: tuple[int, ...]  # entering-layer indices into the target (features.py convention)
    target_hidden_size: int
    vocab_size: int
    head_dim: int
    draft_vocab_size: int | None = None  # EAGLE-3's reduced vocabulary (d2t / t2d)
    rope_theta: float | None = None  # None: the drafter reads the target's RoPE tables
    max_position_embeddings: int | None = None


def facts(raw: Mapping[str, Any], kind: str) -> DrafterFacts:
    if kind == "eagle3":
        return DrafterFacts(tuple(raw["feature_layers"]), raw["target_hidden_size"], raw["vocab_size"],
                            raw["head_dim"], raw["draft_vocab_size"], raw.get("rope_theta", 10000.0),
                            raw.get("max_position_embeddings", 2048))
    if kind == "eagle3-export":
        return DrafterFacts(tuple(raw["eagle_aux_hidden_state_layer_ids"]), raw["target_hidden_size"],
                            raw["vocab_size"], raw["head_dim"], raw["draft_vocab_size"], raw["rope_theta"],
                            raw["max_position_embeddings"])
    c = raw["verispec_config"]
    return DrafterFacts(tuple(i + 1 for i in c["target_layer_ids"]), c["hidden_size"], c["vocab_size"],
                        c["head_dim"])


def layer_ids(f: DrafterFacts, t: ModelConfig) -> Check:
    name = "interface: layer ids"
    bad = [i for i in f.feature_layers if not 0 <= i <= t.num_layers]
    if bad:
        return failed(name, f"reads entering-layer states {list(f.feature_layers)}",
                      f"layer ids {bad} are out of range: the target has {t.num_layers} layers "
                      f"(valid 0..{t.num_layers})")
    return passed(name, f"reads {list(f.feature_layers)} of 0..{t.num_layers}")


def hidden_size(f: DrafterFacts, t: ModelConfig) -> Check:
    name = "interface: hidden size"
    if f.target_hidden_size != t.hidden_size:
        return failed(name, f"drafter expects {f.target_hidden_size}",
                      f"the drafter was built for a target hidden size {f.target_hidden_size}, this target has "
                      f"{t.hidden_size}")
    if f.head_dim != t.head_dim:
        return failed(name, f"head_dim {f.head_dim}", f"the drafter's head_dim {f.head_dim} != the target's "
                      f"{t.head_dim} (it rotates with the target's RoPE tables)")
    return passed(name, f"{t.hidden_size} (head_dim {t.head_dim})")


def vocabulary(f: DrafterFacts, t: ModelConfig) -> Check:
    name = "interface: vocabulary"
    if f.vocab_size != t.vocab_size:
        return failed(name, f"drafter vocabulary {f.vocab_size}",
                      f"the drafter's vocabulary has {f.vocab_size} ids, the target's {t.vocab_size}")
    extra = f", draft vocabulary {f.draft_vocab_size}" if f.draft_vocab_size is not None else ""
    return passed(name, f"{t.vocab_size}{extra}")


def vocab_maps(d2t: torch.Tensor | None, t2d: torch.Tensor | None, draft_vocab: int, vocab: int) -> Check:
    """EAGLE-3's maps: target id = draft id + d2t[draft id]; t2d marks exactly those target ids."""
    name = "interface: d2t / t2d maps"
    if d2t is None or t2d is None:
        return failed(name, "maps absent", "the checkpoint has no d2t / t2d tensors")
    if d2t.shape != (draft_vocab,) or t2d.shape != (vocab,):
        return failed(name, f"d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}",
                      f"expected d2t [{draft_vocab}] (draft_vocab_size) and t2d [{vocab}] (vocab_size)")
    targets = torch.arange(draft_vocab) + d2t.long().cpu()
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        return failed(name, "d2t", f"d2t maps draft ids outside the target vocabulary 0..{vocab - 1}")
    marked = torch.nonzero(t2d.bool().cpu()).flatten()
    if len(set(targets.tolist())) != draft_vocab or sorted(targets.tolist()) != marked.tolist():
        miss = sorted(set(targets.tolist()) ^ set(marked.tolist()))[:5]
        return failed(name, f"t2d marks {marked.numel()} ids, d2t maps {draft_vocab}",
                      f"d2t and t2d disagree (first differing target ids {miss}): a draft token would map to an "
                      "id the head does not own")
    return passed(name, f"{draft_vocab} draft ids -> distinct target ids, t2d agrees")


def tokenizer(target_vocab: Mapping[str, int] | None, drafter_vocab: Mapping[str, int] | None) -> Check:
    name = "interface: tokenizer"
    if drafter_vocab is None:
        return passed(name, "the drafter ships no tokenizer: it uses the target's ids (vocabulary size checked)")
    if target_vocab is None:
        return failed(name, "drafter has a tokenizer", "the target has no tokenizer to compare the drafter's with")
    if dict(target_vocab) != dict(drafter_vocab):
        diff = sorted(set(target_vocab.items()) ^ set(drafter_vocab.items()))[:3]
        return failed(name, f"{len(drafter_vocab)} vs {len(target_vocab)} entries",
                      f"the drafter's tokenizer differs from the target's (e.g. {diff}): token ids would not mean "
                      "the same text")
    return passed(name, f"identical ({len(target_vocab)} entries)")


def rope(f: DrafterFacts, t: ModelConfig) -> Check:
    """EAGLE-3 exports build their own RoPE from the draft config (vLLM / SGLang): it must be the target's."""
    name = "interface: RoPE / positions"
    if f.rope_theta is None:
        return passed(name, f"the target's RoPE tables ({t.rope_type}, theta {t.rope_theta:g}), target positions")
    problems = []
    if float(f.rope_theta) != float(t.rope_theta):
        problems.append(f"rope_theta {f.rope_theta:g} != the target's {t.rope_theta:g}")
    if f.max_position_embeddings is not None and f.max_position_embeddings < t.max_position_embeddings:
        problems.append(f"max_position_embeddings {f.max_position_embeddings} < the target's "
                        f"{t.max_position_embeddings}")
    if t.rope_type != "default":
        problems.append(f"the target uses {t.rope_type} RoPE scaling, the head's config carries none")
    if problems:
        return failed(name, f"theta {f.rope_theta:g}, {f.max_position_embeddings} positions", "; ".join(problems))
    return passed(name, f"theta {t.rope_theta:g}, {f.max_position_embeddings} positions, same as the target")


def all_checks(f: DrafterFacts, t: ModelConfig, maps: tuple[torch.Tensor | None, torch.Tensor | None] | None,
               target_vocab: Mapping[str, int] | None, drafter_vocab: Mapping[str, int] | None) -> list[Check]:
    out = [layer_ids(f, t), hidden_size(f, t), vocabulary(f, t)]
    if maps is not None:
        out.append(vocab_maps(maps[0], maps[1], f.draft_vocab_size or 0, f.vocab_size))
    out += [tokenizer(target_vocab, drafter_vocab), rope(f, t)]
    return out
