"""`EngineArgs`: everything an `LLM` is built from, each default written once.

The Python API (`LLM(**kwargs)` is `LLM.from_engine_args(EngineArgs(**kwargs))`), the command line
(`verispec generate` and `verispec serve` map their flags onto these fields by name: `from_namespace`) and the server
build from the same dataclass, as vLLM's EngineArgs serves its LLM, CLI and server. A setting's path from the command
line to the engine is one hop per layer: flag -> field -> LLM attribute -> EngineConfig.

`verispec serve` serves many clients at once; its flags default to SERVE_DEFAULTS where it differs from a script.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, Mapping

from verispec.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_SEQS, KV_CACHE_DTYPES, SpeculativeConfig
from verispec.models.hub import DEFAULT_MODEL


@dataclass(frozen=True)
class EngineArgs:
    model: str = DEFAULT_MODEL  # known model name, .gguf file, HF directory or hub id
    dtype: str = "auto"  # auto: the weight path this machine runs fastest, measured (execution/autotune.py)
    device: str | None = None  # cpu or cuda; None: cuda when available
    max_model_len: int | None = None  # None: the model's own, capped at 4096 (api.py's DEFAULT_CONTEXT_CAP)
    quantization: str | None = None  # gguf | gguf-q8act; None: as dtype auto chooses
    invariant: bool | None = None  # batch invariance: None = where the linears measure row-invariant
    adaptive_threads: bool = False  # kernel threads per step chosen by measurement (gguf-q8act; thread_governor.py)
    # vLLM's speculative_config (a dict, parsed once by LLM after the shipped drafter is filled in) or a parsed one
    speculative_config: Mapping[str, Any] | SpeculativeConfig | None = None
    check_state: bool = False  # the state oracle after every step (slow; for debugging)
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # requests decoding at once
    scheduler: str | None = None  # static | goodput | dspark; None: dspark when speculation adapts, else static
    max_num_batched_tokens: int | None = None  # tokens per forward; None: max(512, max_num_seqs x (K + 1))
    kv_cache_memory_bytes: int | None = None  # None: max_num_seqs full-length requests, capped (api.py)
    block_size: int = DEFAULT_BLOCK_SIZE  # positions per paged-KV block
    enable_prefix_caching: bool = False
    kv_cache_dtype: str = "auto"  # auto: float32 on CPU, the model's dtype on CUDA; or float32 / float16
    progress: bool = True  # progress bars and the chosen path on stderr

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)}")
        if self.block_size < 1 or (self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0):
            raise ValueError("block_size and kv_cache_memory_bytes must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, **overrides: Any) -> "EngineArgs":
        """The fields a parsed command line names (flags spelled as the fields, --max-num-seqs = max_num_seqs);
        `overrides` (say, speculative_config built from several flags) win. A flag left at None takes the field's
        default."""
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if getattr(args, f.name, None) is not None}
        return cls(**{**given, **overrides})


# `verispec serve`'s defaults where many clients want other values than one script: more requests at once, a context
# that keeps sixteen of them near 1.5 GB on CPU, the confidence scheduler, and prompts' shared prefixes cached.
SERVE_DEFAULTS: dict[str, Any] = {"max_num_seqs": 16, "max_model_len": 2048, "scheduler": "dspark",
                                  "enable_prefix_caching": True}
