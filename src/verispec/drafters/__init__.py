"""Drafters behind one protocol (base.Draft / base.Drafter), created per request by a DrafterFactory.

`DRAFTERS` maps every speculative method (config.SPEC_METHODS) to the constructor of its per-request drafter, and
`LEARNED_LOADERS` every learned method (config.LEARNED_METHODS) to the loader of its trained module; an unknown
method is a ValueError naming the known ones.
"""

from __future__ import annotations

from typing import Any, Callable

from verispec.config import BENCH_METHODS, LEARNED_METHODS, SPEC_METHODS, SpeculativeConfig
from verispec.drafters.base import Drafter
from verispec.sampling import SamplingParams


class DrafterFactory:
    """Holds what drafters share across requests (a draft model and its cache, the suffix cache); with
    `hybrid`, each request's model drafter goes behind a model-free one (drafters/hybrid.py)."""

    def __init__(self, cfg: SpeculativeConfig, target=None, target_tokenizer=None, max_len: int = 4096,
                 num_slots: int = 1) -> None:
        if cfg.method not in DRAFTERS and cfg.method not in BENCH_DRAFTERS:
            raise ValueError(_unknown(cfg.method, DRAFTERS))
        self.cfg = cfg
        self.draft_model = None
        self.draft_cache = None
        self.suffix_cache = None
        self.ngram_survival = None  # n-gram drafts' survival by match length, scored in hindsight (drafters/hindsight.py)
        self.learned = None  # a trained EAGLE-3 / DFlash / DSpark drafter module, or the target's MTP layers
        self.mtp_cache = None
        self.max_len = max_len
        self.synthetic = None  # method synthetic: the finished streams its drafts copy (drafters/synthetic.py)
        self.vocab_size = target.cfg.vocab_size if target is not None else None
        if cfg.method in BENCH_METHODS:
            from verispec.drafters.synthetic import SyntheticReference

            self.synthetic = SyntheticReference()
        if cfg.method in LEARNED_METHODS:
            assert target is not None
            self.learned = load_learned(cfg.method, cfg.model, target, cfg.quantization)  # type: ignore[arg-type]
        if cfg.method == "mtp":
            from verispec.drafters.mtp import load as load_mtp

            assert target is not None
            self.learned = load_mtp(cfg.model, target)  # type: ignore[arg-type]
            self.mtp_cache = self.learned.new_cache(min(max_len, target.max_positions), num_slots)
        if cfg.method == "draft_model":
            from verispec.drafters.draft_model import check_compatible
            from verispec.models.loader import load_model, load_tokenizer

            assert target is not None
            dtype = cfg.draft_dtype or target.dtype
            self.draft_model, resolved = load_model(cfg.model, dtype=dtype, device=target.device, max_len=max_len,
                                                    progress=False)  # RoPE tables for the context, not the model's
            check_compatible(target, self.draft_model, target_tokenizer, load_tokenizer(resolved))
            if cfg.draft_tree:
                self.draft_model.cfg.check_tree_depth(cfg.num_speculative_tokens, "the draft model")
            self.draft_cache = self.draft_model.new_cache(min(max_len, self.draft_model.cfg.max_position_embeddings),
                                                          num_slots=num_slots)
        self.reset_shared()

    @property
    def weight_format(self) -> str | None:
        """What a learned drafter's linears run as: their GGUF block format on verispec's CPU kernel (Q8_0, Q4_1,
        Q4_0), else their float dtype; None for the other methods (every output's stats say it)."""
        if self.learned is None or self.cfg.method not in LEARNED_METHODS:
            return None
        kernel = getattr(self.learned, "kernel", None)
        return kernel.kind if kernel is not None else str(self.learned.dtype).removeprefix("torch.")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states every forward must capture for these drafters (() for most)."""
        return tuple(self.learned.feature_layers) if self.learned is not None else ()

    def reset_shared(self) -> None:
        """Forget what drafters learned across requests (the suffix cache of earlier outputs, the n-gram drafts'
        survival)."""
        free = {self.cfg.method, self.cfg.hybrid}  # the method's drafter and a hybrid's model-free one
        if "ngram" in free:
            from verispec.drafters.hindsight import SurvivalTable

            self.ngram_survival = SurvivalTable()
        if "suffix" in free:
            from verispec.drafters.suffix import SuffixCache

            self.suffix_cache = SuffixCache()

    def new(self, params: SamplingParams, prompt_len: int) -> Drafter | None:
        """The drafter of one request (None for method none)."""
        make = DRAFTERS.get(self.cfg.method) or BENCH_DRAFTERS.get(self.cfg.method)
        if make is None:
            raise ValueError(_unknown(self.cfg.method, DRAFTERS))
        drafter = make(self, params, prompt_len)
        if self.cfg.hybrid is None or drafter is None:
            return drafter
        from verispec.drafters.hybrid import HybridDrafter

        free = DRAFTERS[self.cfg.hybrid](self, params, prompt_len)
        assert free is not None
        return HybridDrafter(free, drafter)


# ---- the registries ------------------------------------------------------------------------------------------
def _unknown(method: str, known: dict[str, Any]) -> str:
    return f"unknown speculative method {method!r}; known methods: {', '.join(known)}"


def _no_drafter(f: DrafterFactory, params: SamplingParams, prompt_len: int) -> None:
    return None


def _ngram(f: DrafterFactory, params: SamplingParams, prompt_len: int) -> Drafter:
    from verispec.drafters.ngram import NgramConfig, NgramDrafter

    return NgramDrafter(NgramConfig(f.cfg.prompt_lookup_max, f.cfg.prompt_lookup_min), f.ngram_survival)


def _suffix(f: DrafterFactory, params: SamplingParams, prompt_len: int) -> Drafter:
    from verispec.drafters.suffix import SuffixDrafter

    return SuffixDrafter(f.suffix_cache, prompt_len=prompt_len)


def _draft_model(f: DrafterFactory, params: SamplingParams, prompt_len: int) -> Drafter:
    from verispec.drafters.draft_model import DraftModelDrafter

    return DraftModelDrafter(f.draft_model, f.draft_cache, params)  # type: ignore[arg-type]


def _eagle3(f: DrafterFactory, params: SamplingParams, prompt_len: int) -> Drafter:
    from verispec.drafters.eagle3 import Eagle3Drafter

    return Eagle3Drafter(f.learned, params, f.max_len)  # type: ignore[arg-type]


def _block(f: DrafterFactory, params: SamplingParams, prompt_len: int) -> Drafter:
    from verispec.drafters.dflash import DFlashDrafter

    return DFlashDrafter(f.learned, params)  # type: ignore[arg-type]


def _mtp(f: DrafterFactory, params: SamplingParams, prompt_len: int) -> Drafter:
    from verispec.drafters.mtp import MTPDrafter

    return MTPDrafter(f.learned, f.mtp_cache, params)  # type: ignore[arg-type]


# method -> the per-request drafter (or None: plain decoding)
DRAFTERS: dict[str, Callable[[DrafterFactory, SamplingParams, int], Drafter | None]] = {
    "none": _no_drafter,
    "ngram": _ngram,
    "suffix": _suffix,
    "draft_model": _draft_model,
    "eagle3": _eagle3,
    "dflash": _block,
    "dspark": _block,  # DFlash's block drafter with DSpark's Markov and confidence heads
    "mtp": _mtp,  # the target checkpoint's own MTP layers
}
assert tuple(DRAFTERS) == SPEC_METHODS, "every speculative method needs a drafter constructor"


def _synthetic(f: DrafterFactory, params: SamplingParams, prompt_len: int) -> Drafter:
    from verispec.drafters.synthetic import SyntheticDrafter

    assert f.synthetic is not None and f.vocab_size is not None and f.cfg.synthetic_tau is not None
    return SyntheticDrafter(f.synthetic, f.cfg.synthetic_tau, f.cfg.num_speculative_tokens, f.vocab_size,
                            prompt_len, seed=params.seed or 0)


# benchmark-only method -> its per-request drafter (config.BENCH_METHODS; never a --method choice)
BENCH_DRAFTERS: dict[str, Callable[[DrafterFactory, SamplingParams, int], Drafter | None]] = {
    "synthetic": _synthetic,
}
assert tuple(BENCH_DRAFTERS) == BENCH_METHODS


def _load_eagle3(method: str, directory, target, path: str, kind: str | None):
    from verispec.drafters.eagle3 import load

    return load(directory, target, kind=kind)


def _load_block(method: str, directory, target, path: str, kind: str | None):
    from verispec.drafters.dflash import load

    model = load(directory, target, kind=kind)
    is_dspark = bool(getattr(model.cfg, "dspark", False))
    if is_dspark != (method == "dspark"):
        raise ValueError(f"{path} holds a {'DSpark' if is_dspark else 'DFlash'} drafter; use --method "
                         f"{'dspark' if is_dspark else 'dflash'}")
    return model


# learned method -> the loader of its trained module (method, checkpoint directory, target, what the user gave,
# the GGUF block format of its linears beside a gguf-q8act target, None: the default)
LEARNED_LOADERS: dict[str, Callable[..., Any]] = {
    "eagle3": _load_eagle3,
    "dflash": _load_block,
    "dspark": _load_block,
}
assert tuple(LEARNED_LOADERS) == LEARNED_METHODS, "every learned method needs a loader"


def load_learned(method: str, path: str, target, quantization: str | None = None):
    """Load a trained drafter (a directory, or a shipped drafter's name) for `target`; checks the method matches.
    `quantization` (config.DRAFT_QUANTIZATIONS): the block format of its linears beside a gguf-q8act target (None:
    the default); naming one for a target on another path is an error (the drafter stays float there)."""
    from verispec.drafters.shipped import resolve

    loader = LEARNED_LOADERS.get(method)
    if loader is None:
        raise ValueError(f"{method!r} is not a learned drafter method; known: {', '.join(LEARNED_LOADERS)}")
    if quantization is not None and getattr(target, "decoder_kernel", None) is None:
        raise ValueError(f"quantization {quantization!r}: learned drafters are rounded to GGUF blocks only beside a "
                         f"target on the gguf-q8act path (a GGUF target, dtype auto on a CPU that picks it)")
    return loader(method, resolve(path), target, path, quantization.upper() if quantization else None)
