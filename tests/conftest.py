"""Fixtures shared by several test modules. Plain helper functions live in tests/helpers.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import CTX, EOS, VOCAB


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama with the default model's tokenizer files, so text prompts and chat work."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from verispec.models.hub import DEFAULT_MODEL
    from verispec.models.loader import resolve

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CTX, bos_token_id=1,
                      eos_token_id=EOS)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-llama-tok")
    LlamaForCausalLM(cfg).save_pretrained(out)
    src = resolve(DEFAULT_MODEL, progress=False).directory
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="module")
def hf(tiny_dir: Path):
    """HF transformers' own model on `tiny_dir`, fp32, eval mode: the oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tiny_dir: Path):
    """HF's tokenizer from `tiny_dir` (the default model's tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))
