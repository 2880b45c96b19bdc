"""verispec: lossless speculative decoding for Llama-family models.

The public names load on first use (PEP 562), so importing one layer (say `verispec.engine.scheduler`) does not
pull in the model, torch or the server.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verispec.api import LLM, RequestOutput
    from verispec.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_PUBLIC = {"LLM": "verispec.api", "RequestOutput": "verispec.api", "SamplingParams": "verispec.sampling"}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'verispec' has no attribute {name!r}")
