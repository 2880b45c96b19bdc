"""Drafters behind one protocol (base.Draft / base.Drafter), created per request by a DrafterFactory."""

from __future__ import annotations

from verispec.config import LEARNED_METHODS, SpeculativeConfig
from verispec.drafters.base import Drafter
from verispec.execution.sampling import SamplingParams


class DrafterFactory:
    """Holds what drafters share across requests (a draft model and its cache, the suffix cache)."""

    def __init__(self, cfg: SpeculativeConfig, target=None, target_tokenizer=None, max_len: int = 4096,
                 num_slots: int = 1) -> None:
        self.cfg = cfg
        self.draft_model = None
        self.draft_cache = None
        self.suffix_cache = None
        self.learned = None  # a trained EAGLE-3 / DFlash / DSpark drafter module
        self.max_len = max_len
        if cfg.method in LEARNED_METHODS:
            assert target is not None
            self.learned = load_learned(cfg.method, cfg.model, target)  # type: ignore[arg-type]
        if cfg.method == "draft_model":
            from verispec.drafters.draft_model import check_compatible
            from verispec.models.loader import load_model, load_tokenizer

            assert target is not None
            dtype = cfg.draft_dtype or target.dtype
            self.draft_model, resolved = load_model(cfg.model, dtype=dtype, device=target.device, progress=False)
            check_compatible(target, self.draft_model, target_tokenizer, load_tokenizer(resolved))
            self.draft_cache = self.draft_model.new_cache(min(max_len, self.draft_model.cfg.max_position_embeddings),
                                                          num_slots=num_slots)
        self.reset_shared()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states every forward must capture for these drafters (() for most)."""
        return tuple(self.learned.feature_layers) if self.learned is not None else ()

    def reset_shared(self) -> None:
        """Forget what drafters learned across requests (the suffix cache of earlier outputs)."""
        if self.cfg.method == "suffix":
            from verispec.drafters.suffix import SuffixCache

            self.suffix_cache = SuffixCache()

    def new(self, params: SamplingParams, prompt_len: int) -> Drafter | None:
        m = self.cfg.method
        if m == "none":
            return None
        if m == "ngram":
            from verispec.drafters.ngram import NgramConfig, NgramDrafter

            return NgramDrafter(NgramConfig(self.cfg.prompt_lookup_max, self.cfg.prompt_lookup_min))
        if m == "suffix":
            from verispec.drafters.suffix import SuffixDrafter

            return SuffixDrafter(self.suffix_cache, prompt_len=prompt_len)
        if m == "eagle3":
            from verispec.drafters.eagle3 import Eagle3Drafter

            return Eagle3Drafter(self.learned, params, self.max_len)  # type: ignore[arg-type]
        if m in ("dflash", "dspark"):
            from verispec.drafters.dflash import DFlashDrafter

            return DFlashDrafter(self.learned, params)  # type: ignore[arg-type]
        from verispec.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter(self.draft_model, self.draft_cache, params)


def load_learned(method: str, path: str, target):
    """Load a trained drafter (a directory, or a shipped drafter's name) for `target`; checks the method matches."""
    from verispec.drafters.shipped import resolve

    directory = resolve(path)
    if method == "eagle3":
        from verispec.drafters.eagle3 import load

        return load(directory, target)
    from verispec.drafters.dflash import load as load_block

    model = load_block(directory, target)
    is_dspark = bool(getattr(model.cfg, "dspark", False))
    if is_dspark != (method == "dspark"):
        raise ValueError(f"{path} holds a {'DSpark' if is_dspark else 'DFlash'} drafter; use --method "
                         f"{'dspark' if is_dspark else 'dflash'}")
    return model
