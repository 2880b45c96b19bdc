"""A GGUF's converted directory loads its tokenizer through the class it was saved under (models/loader.py's
`load_tokenizer`): the same tokenizer as transformers' AutoTokenizer gives for that directory (the oracle), without
AutoTokenizer's import of the model family's modelling stack."""

from __future__ import annotations

import subprocess
import sys

import pytest

from verispec.models.hub import DEFAULT_MODEL
from verispec.models.loader import load_tokenizer, resolve

TEXTS = ["Hello world", " leading space and  two", "Ünïcödé ✓ 🙂\n\n\ttab end", "<|im_start|>user\nhi<|im_end|>",
         "def f(x):\n    return x ** 2  # code", "1234567890 3.14159 -2e10"]


@pytest.fixture(scope="module")
def resolved():
    return resolve(DEFAULT_MODEL, progress=False)


def test_the_default_models_tokenizer_is_autotokenizers(resolved) -> None:
    from transformers import AutoTokenizer

    ours, ref = load_tokenizer(resolved), AutoTokenizer.from_pretrained(str(resolved.directory))
    assert resolved.gguf is not None and type(ours) is type(ref)
    assert len(ours) == len(ref) and ours.all_special_ids == ref.all_special_ids
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (ref.eos_token_id, ref.bos_token_id,
                                                                           ref.pad_token_id)
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == ids and ours.decode(ids) == ref.decode(ids)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    assert (ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


def test_loading_it_does_not_import_the_model_familys_modelling_stack(resolved) -> None:
    """In a fresh interpreter (this one has imported everything already): AutoTokenizer reads the model's config,
    which imports transformers' Llama configuration and, behind it, accelerate; loading by the saved class does
    not."""
    code = ("import sys; from verispec.models.loader import load_tokenizer, resolve; "
            f"t = load_tokenizer(resolve({DEFAULT_MODEL!r}, progress=False)); "
            "print(len(t), 'transformers.models.llama.configuration_llama' in sys.modules, 'accelerate' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.split()[-3:] == ["49152", "False", "False"]


def test_a_directory_without_a_saved_class_still_loads_through_autotokenizer(resolved, tmp_path) -> None:
    import json
    import shutil

    import dataclasses

    d = tmp_path / "converted"
    shutil.copytree(resolved.directory, d, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("tokenizer_class", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(dataclasses.replace(resolved, directory=d))
    assert tok(TEXTS[0])["input_ids"] == load_tokenizer(resolved)(TEXTS[0])["input_ids"]
