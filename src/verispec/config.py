"""Frozen configuration dataclasses, validated once at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

CACHE_ENV = "VERISPEC_CACHE"


def cache_dir() -> Path:
    """Root of verispec's cache (models, converted checkpoints, built kernels, measured choices):
    ``$VERISPEC_CACHE`` or ``~/.cache/verispec``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "verispec"


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3, Mistral)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always; Llama optionally)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None
    # one flag per layer: True where that layer attends only to the last `sliding_window` positions
    sliding_layers: tuple[bool, ...] = field(default=())
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    mtp_layers: int = 0  # native multi-token-prediction layers the checkpoint declares (num_nextn_predict_layers)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; verispec implements {SUPPORTED_MODEL_TYPES}"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.sliding_layers) not in (0, self.num_layers):
            raise ValueError("sliding_layers must give one flag per layer")
        if any(self.sliding_layers) and not self.sliding_window:
            raise ValueError("sliding layers need a positive sliding_window")

    def layer_window(self, layer: int) -> int | None:
        """The attention window of one layer, or None for full attention."""
        if self.sliding_layers and self.sliding_layers[layer]:
            return self.sliding_window
        return None

    def check_tree_depth(self, depth: int, who: str) -> None:
        """A draft tree of `depth` levels needs every ancestor inside each row's attention window."""
        windows = [w for w in (self.layer_window(i) for i in range(self.num_layers)) if w is not None]
        if windows and min(windows) <= depth:
            raise ValueError(f"draft_tree: {who}'s sliding window of {min(windows)} positions is not longer than "
                             f"the tree's depth (up to num_speculative_tokens = {depth}); lower "
                             "num_speculative_tokens or draft chains")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dictionary (transformers 4.x or 5.x layout)."""
        model_type = cfg.get("model_type", "llama")
        if model_type == "smollm2":
            model_type = "llama"
        if model_type == "mimo":  # Xiaomi MiMo: a Qwen2 decoder (q/k/v bias) plus MTP layers (models/mtp_layout.py)
            model_type = "qwen2"
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        num_layers = int(cfg["num_hidden_layers"])

        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"

        window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        if layer_types:
            sliding = tuple(t == "sliding_attention" for t in layer_types)
        elif model_type == "mistral" and window:
            sliding = (True,) * num_layers
        elif model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and window:
            first_full = int(cfg.get("max_window_layers", num_layers))
            sliding = tuple(i >= first_full for i in range(num_layers))
        else:
            sliding = (False,) * num_layers
        if not any(sliding):
            window = None

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_positions=int(rope.get("original_max_position_embeddings", 8192)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type not in ("qwen2",) and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=int(window) if window else None,
            sliding_layers=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        )


# Every speculative method, defined here once: SpeculativeConfig, the drafter registry (drafters/__init__.py), the
# CLI's --method choices and `bench single` read these.
MODEL_FREE_METHODS = ("ngram", "suffix")  # drafting from the request's own tokens (and earlier outputs)
LEARNED_METHODS = ("eagle3", "dflash", "dspark")  # trained heads reading the target's hidden states
NATIVE_METHODS = ("mtp",)  # drafting layers the target's own checkpoint ships (drafters/mtp.py)
# load_model's quantization values: "gguf" (a GGUF's Q4 blocks on aten's int4 kernel, bf16 activations) and
# "gguf-q8act" (its blocks and head on verispec's CPU kernel, int8 activations per 32 values); None = dense weights
QUANTIZATIONS = ("gguf", "gguf-q8act")
# `kv_cache_dtype` values: "auto" keeps K/V in float32 on CPU (the model's dtype elsewhere); "float16" halves what
# attention reads and what each cached position holds, K/V rounded to nearest even as written (the same in plain and
# speculative steps, so greedy speculation still equals plain decoding bit for bit)
KV_CACHE_DTYPES = ("auto", "float32", "float16")
SPEC_METHODS = ("none", *MODEL_FREE_METHODS, "draft_model", *LEARNED_METHODS, *NATIVE_METHODS)
# GGUF block formats a learned drafter's float linears are rounded to beside a gguf-q8act target
# (speculative_config "quantization"); the default: drafts about as good as Q8_0's at half the bytes read per draft
# token (verispec bench drafters, formats side by side: docs/results/drafters.md)
DRAFT_QUANTIZATIONS = ("q8_0", "q4_1", "q4_0")
DEFAULT_DRAFT_QUANTIZATION = "q4_0"
TREE_METHODS = ("ngram", "suffix", "eagle3", "dflash", "dspark", "draft_model")  # the drafters with a propose_tree
HYBRID_METHODS = ("draft_model", *LEARNED_METHODS, *NATIVE_METHODS)  # model drafters a hybrid's model-free one precedes
# benchmark-only methods, outside SPEC_METHODS (so never a --method choice): `synthetic`, drafts accepted at a set mean
# length (drafters/synthetic.py), labelled lossy, refused without `benchmark_only=True` and by generate and serve
BENCH_METHODS = ("synthetic",)


# Defaults that more than one layer reads, written once here (the engine's EngineConfig, the API's EngineArgs and the
# CLI's flags take them from these names).
DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # K, the most draft tokens per request and step
DEFAULT_MAX_NUM_SEQS = 4  # requests decoding at once in one LLM (the server's own default: engine/args.py)
DEFAULT_BLOCK_SIZE = 16  # positions per paged-KV block
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512  # tokens in one forward, at least (the engine raises it to a full decode step)
# CPU threads chosen per step by measurement (execution/thread_governor.py): at least this many steps of one size
# between two probes of a neighbouring thread count, and the probes' measured time at most this share of the time
THREAD_PROBE_EVERY = 64
THREAD_PROBE_SHARE = 0.05


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys, plus verispec's acceptance-rule and adaptivity switches."""

    method: str = "none"
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    # the draft model (draft_model), the trained drafter's directory (eagle3/dflash/dspark) or the checkpoint whose
    # MTP layers draft (mtp; LLM fills in the target's own directory)
    model: str | None = None
    draft_dtype: str | None = None  # default: the target's dtype
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    adaptive: bool = True  # choose k per step from measured costs and acceptance (False: always k)
    acceptance_rule: str = "exact"  # exact | threshold | typical (the last two are lossy)
    threshold_single: float = 1.0
    threshold_acc: float = 1.0
    # verify a token tree of up to num_speculative_tokens nodes per step instead of a chain (SGLang's
    # speculative_num_draft_tokens); the TREE_METHODS drafters propose trees so far, with the exact rule.
    # "auto": per request and step, the shape expected to commit more tokens per second (engine/acceptance.py's prefer_tree)
    draft_tree: bool | str = False
    # a model-free drafter (ngram or suffix) drafting first each step, the method's model drafter where the policy
    # verifies none of the model-free draft (drafters/hybrid.py; each side with its own acceptance estimate)
    hybrid: str | None = None
    # the GGUF block format (DRAFT_QUANTIZATIONS) of a learned drafter's linears on verispec's CPU kernel, beside a
    # gguf-q8act target (None: DEFAULT_DRAFT_QUANTIZATION; with another target path the drafter stays float and
    # naming one is an error)
    quantization: str | None = None
    # method synthetic: the mean tokens per verification step its drafts are accepted at (the bonus token included,
    # 1..k + 1), and the acknowledgement that this is a lossy benchmark mode (set by the benchmarks only)
    synthetic_tau: float | None = None
    benchmark_only: bool = False

    def __post_init__(self) -> None:
        if self.method in BENCH_METHODS or self.synthetic_tau is not None:
            self._check_benchmark_only()
        elif self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {SPEC_METHODS}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be an integer in 1..64")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method draft_model needs a draft model: speculative_config['model'] / --draft-model")
        if self.method in NATIVE_METHODS and not self.model:
            raise ValueError("method mtp drafts with the target checkpoint's own MTP layers: speculative_config"
                             "['model'] = the target's directory (LLM fills it in)")
        if self.method in LEARNED_METHODS and not self.model:
            raise ValueError(f"method {self.method} needs a trained drafter: speculative_config['model'] = its "
                             f"directory (--draft-model), or a shipped one (`verispec drafters list`; picked by "
                             f"itself when the target is the model it was trained for)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.hybrid is not None:
            self._check_hybrid()
        if self.quantization is not None and (self.quantization not in DRAFT_QUANTIZATIONS
                                              or self.method not in LEARNED_METHODS):
            raise ValueError(f"quantization rounds a learned drafter's weights ({', '.join(LEARNED_METHODS)}) to "
                             f"one of {', '.join(DRAFT_QUANTIZATIONS)}; got {self.quantization!r} for method "
                             f"{self.method!r}")
        if self.draft_tree not in (False, True, "auto"):
            raise ValueError(f"draft_tree takes true, false or \"auto\", got {self.draft_tree!r}")
        if self.draft_tree and (self.method not in TREE_METHODS or self.acceptance_rule != "exact"):
            raise ValueError(f"draft_tree: only the {', '.join(TREE_METHODS)} drafters propose trees so far, "
                             "verified with the exact rule")

    def _check_benchmark_only(self) -> None:
        if self.method not in BENCH_METHODS:
            raise ValueError(f"synthetic_tau goes with method 'synthetic' only, not {self.method!r}")
        if not self.benchmark_only:
            raise ValueError("method 'synthetic' (synthetic acceptance: drafts copied from the target's own earlier "
                             "output at a set mean length) is a lossy benchmark-only mode; it runs under the "
                             "benchmarks (speculative_config['benchmark_only'] = true), never in generate or serve")
        if self.synthetic_tau is None or not 1.0 <= self.synthetic_tau <= self.num_speculative_tokens + 1:
            raise ValueError(f"method 'synthetic' needs synthetic_tau, the mean tokens per verification step, within "
                             f"[1, {self.num_speculative_tokens + 1}] (k + 1); got {self.synthetic_tau!r}")
        if self.draft_tree or self.hybrid is not None or self.acceptance_rule != "exact":
            raise ValueError("method 'synthetic' drafts chains, alone, verified with the exact rule")

    def _check_hybrid(self) -> None:
        if self.hybrid not in MODEL_FREE_METHODS:
            raise ValueError(f"hybrid takes a model-free method ({', '.join(MODEL_FREE_METHODS)}), "
                             f"got {self.hybrid!r}")
        if self.method not in HYBRID_METHODS:
            raise ValueError(f"hybrid {self.hybrid!r} goes with a model drafter ({', '.join(HYBRID_METHODS)}), "
                             f"not method {self.method!r}")
        if self.draft_tree:
            raise ValueError("draft_tree: a hybrid drafter proposes chains only")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | "SpeculativeConfig" | None) -> "SpeculativeConfig":
        if d is None:
            return cls()
        if isinstance(d, SpeculativeConfig):
            return d
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**dict(d))
