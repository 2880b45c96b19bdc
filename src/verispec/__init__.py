"""verispec: lossless speculative decoding for Llama-family models."""

from verispec.api import LLM, RequestOutput
from verispec.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
