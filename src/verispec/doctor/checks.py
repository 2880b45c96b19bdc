"""One small pure function per link of the chain checkpoint -> drafter -> method -> target interface -> verifier.

Each returns a `Check`: its name, whether it passed, what was found (`detail`) and, when it failed, the exact
reason. They read configs, numbers and tensors only; loading and running is in doctor/run.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence


from verispec.config import LEARNED_METHODS, MODEL_FREE_METHODS, SPEC_METHODS
from verispec.doctor.registry_table import METHOD_KINDS, ROUTES, TARGET_MODEL_TYPES, describe, route


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    reason: str = ""  # why it failed ("" when ok)


def passed(name: str, detail: str) -> Check:
    return Check(name, True, detail)


def failed(name: str, detail: str, reason: str) -> Check:
    return Check(name, False, detail, reason)


# ---- the checkpoints' architectures ------------------------------------------------------------------------------
def target_route(cfg: Mapping[str, Any]) -> Check:
    """The target's `architectures` -> our decoder; the name must agree with `model_type`, which is what routes
    ours (vLLM and SGLang route by the name, so a disagreement runs different code in each)."""
    archs, mtype = cfg.get("architectures") or [], cfg.get("model_type", "llama")
    name = "target architecture"
    if not archs:  # a config converted from GGUF: transformers names no class; model_type routes every runtime
        arch = next((a for a, types in TARGET_MODEL_TYPES.items() if mtype in types), None)
        if arch is None:
            return failed(name, f"no architectures, model_type {mtype!r}", f"model_type {mtype!r} is not a decoder "
                          "verispec runs and the config names no architecture")
        r = ROUTES[arch]
        return passed(name, f"no architectures (model_type {mtype} -> {arch}) -> {describe(r)}")
    if len(archs) != 1:
        return failed(name, f"architectures {archs}", "config.json must name exactly one architecture")
    r = route(archs[0])
    if r is None or r.kind != "target":
        return failed(name, f"architectures {archs}", f"{archs[0]} is not a decoder verispec runs; known targets: "
                      f"{', '.join(TARGET_MODEL_TYPES)}")
    if mtype not in TARGET_MODEL_TYPES[archs[0]]:
        return failed(name, f"{archs[0]}, model_type {mtype!r}",
                      f"{archs[0]} routes to the {TARGET_MODEL_TYPES[archs[0]][0]} class in vLLM/SGLang/HF, but "
                      f"model_type {mtype!r} routes ours to the {mtype} variant: the checkpoint names a different "
                      "class than the one its config describes")
    return passed(name, f"{archs[0]} (model_type {mtype}) -> {describe(r)}")


def weight_formats(kinds: Mapping[str, int], native: Sequence[str], fallback_note: str) -> str:
    """One line on a GGUF target's linear weights: each format and its tensor count, which run on verispec's native
    kernel bodies, and (`fallback_note`, "" when none) which fall back to dense and at what cost."""
    listed = ", ".join(f"{k} x{n}{'' if k in native else ' (dense)'}" for k, n in sorted(kinds.items()))
    return f"GGUF linears: {listed}" + (f"; {fallback_note}" if fallback_note else "; every quantised one native")


def drafter_kind(raw: Mapping[str, Any]) -> str | None:
    archs = raw.get("architectures") or []
    r = route(archs[0]) if len(archs) == 1 else None
    return r.kind if r is not None else None


def drafter_route(raw: Mapping[str, Any], method: str) -> Check:
    """The drafter's `architectures` -> a runtime class that implements `method`."""
    archs = raw.get("architectures") or []
    name = "drafter architecture"
    if len(archs) != 1:
        return failed(name, f"architectures {archs}", "the drafter's config.json must name exactly one architecture")
    r = route(archs[0])
    if r is None:
        return failed(name, archs[0], f"{archs[0]} is in no runtime's table (verispec, vLLM, SGLang)")
    want = METHOD_KINDS.get(method, ())
    if r.kind not in want or r.ours is None:
        runs = f"; vLLM/SGLang route it to {r.vllm or r.sglang}" if (r.vllm or r.sglang) else ""
        return failed(name, f"{archs[0]} -> {describe(r)}",
                      f"{archs[0]} is a {r.kind} checkpoint, not the {method} drafter verispec implements{runs}"
                      + (f" ({r.note})" if r.note else ""))
    if r.kind in ("dflash", "dspark") and raw.get("model_type") != r.kind:
        return failed(name, f"{archs[0]}, model_type {raw.get('model_type')!r}",
                      f"architectures says {r.kind} but model_type says {raw.get('model_type')!r}")
    return passed(name, f"{archs[0]} -> {describe(r)}" + (f" ({r.note})" if r.note else ""))


# ---- config fields -------------------------------------------------------------------------------------------------
EAGLE3_REQUIRED = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "rms_norm_eps",
                   "vocab_size", "draft_vocab_size", "feature_layers", "target_hidden_size")
EAGLE3_OPTIONAL = ("rope_theta", "max_position_embeddings", "ttt_steps", "architectures", "target")
EXPORT_REQUIRED = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "num_hidden_layers", "rms_norm_eps", "rope_theta",
                   "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size", "hidden_act",
                   "tie_word_embeddings", "torch_dtype", "eagle_aux_hidden_state_layer_ids", "eagle_config")
DFLASH_REQUIRED = ("architectures", "model_type", "block_size", "num_hidden_layers", "hidden_size", "vocab_size",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
                   "dflash_config", "verispec_config")
DFLASH_INNER_REQUIRED = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                         "target_layer_ids")
DFLASH_INNER_OPTIONAL = ("rms_norm_eps", "num_layers", "block_size", "mask", "dspark", "markov_rank",
                         "confidence_temperatures")
# DFlash's HF-style top-level fields mirror verispec_config: a hand edit of one side is caught
DFLASH_MIRROR = {"hidden_size": "hidden_size", "vocab_size": "vocab_size", "num_attention_heads": "num_heads",
                 "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim", "num_hidden_layers": "num_layers",
                 "intermediate_size": "intermediate_size", "block_size": "block_size"}


def _field_diff(raw: Mapping[str, Any], required: Sequence[str], optional: Sequence[str], where: str) -> str:
    missing = [k for k in required if k not in raw]
    extra = sorted(set(raw) - set(required) - set(optional))
    parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {extra}"] if extra else [])
    return f"{where}: {'; '.join(parts)}" if parts else ""


def config_fields(raw: Mapping[str, Any], kind: str) -> Check:
    """Every field the layout needs is there, none it does not know (a typo or a foreign layout's key)."""
    name = "drafter config fields"
    if kind == "eagle3":
        problems = [_field_diff(raw, EAGLE3_REQUIRED, EAGLE3_OPTIONAL, "config.json")]
    elif kind == "eagle3-export":
        problems = [_field_diff(raw, EXPORT_REQUIRED, (), "config.json")]
        inner = raw.get("eagle_config") or {}
        aux, inner_aux = raw.get("eagle_aux_hidden_state_layer_ids"), inner.get("eagle_aux_hidden_state_layer_ids")
        if inner_aux != aux:
            problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {inner_aux} != "
                            f"eagle_aux_hidden_state_layer_ids {aux}")
        if raw.get("num_hidden_layers") != 1:
            problems.append(f"num_hidden_layers {raw.get('num_hidden_layers')}: an EAGLE-3 head has exactly 1 layer")
    else:
        inner = raw.get("verispec_config") or {}
        problems = [_field_diff(raw, DFLASH_REQUIRED, ("dspark_config", "target"), "config.json"),
                    _field_diff(inner, DFLASH_INNER_REQUIRED, DFLASH_INNER_OPTIONAL, "verispec_config")]
        for top, key in DFLASH_MIRROR.items():
            if top in raw and key in inner and raw[top] != inner[key]:
                problems.append(f"{top} {raw[top]} != verispec_config.{key} {inner[key]}")
        ids = (raw.get("dflash_config") or {}).get("target_layer_ids")
        if ids is not None and "target_layer_ids" in inner and list(ids) != list(inner["target_layer_ids"]):
            problems.append(f"dflash_config.target_layer_ids {ids} != verispec_config.target_layer_ids "
                            f"{inner['target_layer_ids']}")
    problems = [p for p in problems if p]
    if problems:
        return failed(name, f"{kind} layout", "; ".join(problems))
    return passed(name, f"{kind} layout: all {len(raw)} top-level fields known, none missing")


def mtp_layout(cfg: Mapping[str, Any], names: set[str]) -> Check:
    """The target checkpoint's own MTP layers (`--method mtp`): a known layout, the declared layer count, every
    tensor present and a block verispec runs (models/mtp_layout.py)."""
    from verispec.models.mtp_layout import MTPLayoutError, detect, problems

    name = "drafter architecture"
    try:
        layout, count = detect(cfg, names)
    except MTPLayoutError as e:
        return failed(name, "MTP layers of the target checkpoint", str(e))
    bad = problems(layout, names, int(cfg["num_hidden_layers"]), count)
    if bad:
        return failed(name, f"MTP layout {layout.name}", "; ".join(bad))
    fed = "after" if layout.target_post_norm else "before"
    return passed(name, f"MTP layout {layout.name}: {count} layer(s), Llama-family block; reads the target's last "
                        f"layer {fed} its final norm")


# ---- the speculative method ---------------------------------------------------------------------------------------
def method_link(method: str, kind: str | None) -> Check:
    """The method exists, has a drafter constructor and (learned) a loader for this checkpoint kind."""
    from verispec.drafters import DRAFTERS, LEARNED_LOADERS

    name = "speculative method"
    if method not in SPEC_METHODS:
        return failed(name, method, f"unknown method; known: {', '.join(SPEC_METHODS)}")
    ctor = DRAFTERS[method].__name__
    if method in LEARNED_METHODS:
        if kind not in METHOD_KINDS[method]:
            return failed(name, method, f"a {kind} checkpoint cannot run as {method}")
        return passed(name, f"{method}: drafter {ctor}, loader {LEARNED_LOADERS[method].__name__}")
    kinds = ("model-free" if method in MODEL_FREE_METHODS else "the target checkpoint's own MTP layers"
             if method == "mtp" else "no learned checkpoint")
    return passed(name, f"{method} ({kinds}): drafter {ctor}")


# ---- verifier and scheduler ---------------------------------------------------------------------------------------
CONFIDENCE_SOURCES = {"dspark": "the drafter's calibrated confidence head", "suffix": "the suffix trie's "
                      "running-product confidences"}


def scheduler_link(scheduler: str, method: str, rule: str = "exact", calibrated: bool = True) -> Check:
    """The verifier's acceptance rule and what the policy reads; dspark without drafter confidences falls back."""
    from verispec.engine.scheduler import POLICIES

    name = "verifier and scheduler"
    if scheduler not in POLICIES:
        return failed(name, scheduler, f"unknown scheduler; known: {', '.join(POLICIES)}")
    if rule != "exact":
        return failed(name, f"acceptance rule {rule}", f"the {rule} rule is lossy: identity cannot hold")
    if method == "none":
        return passed(name, f"plain decoding ({scheduler} unused): nothing to verify")
    verifier = "exact rejection sampling (greedy: target argmax), lossless"
    source = CONFIDENCE_SOURCES.get(method)
    if scheduler != "dspark":
        return passed(name, f"{verifier}; {scheduler} policy (reads acceptance estimates, not confidences)")
    if source is None:
        return passed(name, f"{verifier}; dspark policy: the {method} drafter gives no confidences, so it falls back "
                      "to the online per-position acceptance estimate (observed per-position rates, the overall "
                      "rate beyond them) for the survival ranking")
    note = "" if calibrated else " (uncalibrated: T_k = 1)"
    return passed(name, f"{verifier}; dspark policy ranks by {source}{note}")
