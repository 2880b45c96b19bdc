"""Resolve a `--model` argument to weights, config and tokenizer, and build our decoder from them.

Accepted forms:
  - a known short name (the default model, `smollm2-135m-instruct`): fetched into the cache on first use;
  - a `.gguf` file: converted once into a cached HF directory (config.json, tokenizer, generation config); its
    dense weights (dequantised through transformers' GGUF reader into model.safetensors there) are written the
    first time a dense path loads it. The gguf-q8act path never needs them: it builds the decoder from the file's
    blocks directly (models/gguf_direct.py), holding no dense linear or embedding.
  - a local Hugging Face directory (config.json + *.safetensors; tokenizer files optional);
  - a hub id (org/name): downloaded through huggingface_hub, wherever a hub is reachable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verispec.config import QUANTIZATIONS, ModelConfig
from verispec.models import hub
from verispec.models.hf_weights import load_hf_state_dict
from verispec.models.llama import LlamaModel

log = logging.getLogger(__name__)

# model_type -> the transformers class a converted directory names in config.json's "architectures"
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
    return DTYPES[dtype]


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the user asked for
    directory: Path  # an HF-layout directory: config.json, *.safetensors, maybe tokenizer files
    gguf: Path | None = None  # the original GGUF file, when the directory was converted from one


def _file_id(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


WEIGHTS_FILE = "model.safetensors"


def convert_gguf(gguf_path: Path, progress: bool = True, weights: bool = True) -> Path:
    """Convert a GGUF file once into an HF directory in the cache (config.json, tokenizer, generation config);
    with `weights`, also its dense float32 weights (model.safetensors, dequantised by transformers' GGUF reader),
    written the first time a caller asks for them. Later calls reuse what is there."""
    out = hub.cache_dir() / "converted" / f"{gguf_path.stem}-{_file_id(gguf_path)}"
    if (out / "complete").exists():
        complete_hf_dir(out)  # a directory converted before it carried every file other tools read
    else:
        prune_converted(out.parent)
        _convert_config(gguf_path, out)
    if weights and not (out / WEIGHTS_FILE).is_file():
        _write_weights(gguf_path, out)
    return out


def prune_converted(root: Path) -> list[Path]:
    """Remove the converted directories whose GGUF is gone or has changed since (its path, size and mtime no longer
    give the directory's id): nothing can ask for them again, and with dense weights each holds the model in
    float32. Run before each new conversion, so re-quantising a file, or deleting test and scratch files, does not
    grow the cache without bound. Returns what was removed."""
    import shutil

    removed = []
    for d in root.glob("*-*") if root.is_dir() else ():
        marker = d / "complete"
        if ".tmp" in d.name or not marker.is_file():
            continue  # being written by some process (renamed only when whole), or not ours
        src = Path(marker.read_text().strip())
        if src.is_file() and d.name.endswith(f"-{_file_id(src)}"):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    if removed:
        log.info("removed %d converted directories of GGUF files that are gone or changed", len(removed))
    return removed


def _convert_config(gguf_path: Path, out: Path) -> None:
    """config.json (with head_dim and llama3 RoPE scaling recovered, models/gguf_config.py), the tokenizer and the
    generation config of a GGUF, written to `out` whole or not at all."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from verispec.models.gguf_config import complete_config

    meta = load_gguf_checkpoint(str(gguf_path))
    hf_cfg = AutoConfig.for_model(**complete_config(gguf_path, meta["config"]))
    if hf_cfg.model_type not in HF_ARCHITECTURES:
        raise ValueError(f"{gguf_path}: GGUF architecture {hf_cfg.model_type!r} is not a Llama-family decoder")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    hf_cfg.architectures = [HF_ARCHITECTURES[hf_cfg.model_type]]
    hf_cfg.save_pretrained(tmp)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tok.save_pretrained(tmp)
    except Exception as e:  # a GGUF without tokenizer metadata still serves token-id prompts
        log.warning("no tokenizer could be read from %s: %s", gguf_path, e)
    complete_hf_dir(tmp)
    (tmp / "complete").write_text(str(gguf_path.resolve()))
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _write_weights(gguf_path: Path, out: Path) -> None:
    """The GGUF's tensors dequantised by transformers' GGUF reader into `out`/model.safetensors (float32, HF names,
    tagged "pt"), whole or not at all."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(out)))
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    tmp = out / f"{WEIGHTS_FILE}.tmp{os.getpid()}"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS_FILE)


def hf_directory(model: str | os.PathLike) -> Path:
    """`model` as a complete Hugging Face directory: config.json (with "architectures"), generation config, tokenizer
    files and dense weights. For a GGUF (or a known name), its converted directory with the weights written once;
    what other tools take as the target (llama.cpp's converter's --target-model-dir, transformers)."""
    return with_weights(resolve(model, progress=False)).directory


def with_weights(resolved: ResolvedModel) -> ResolvedModel:
    """`resolved` with dense weights on disk: a GGUF's converted directory gains its model.safetensors (once)."""
    if resolved.gguf is None or any(resolved.directory.glob("*.safetensors")):
        return resolved
    return ResolvedModel(resolved.name, convert_gguf(resolved.gguf, progress=False), resolved.gguf)


def complete_hf_dir(directory: Path) -> None:
    """Make a converted directory one other tools take as a Hugging Face model: config.json names its class
    ("architectures": llama.cpp's convert_hf_to_gguf.py routes on it, also as --target-model-dir of a draft),
    generation_config.json holds its BOS / EOS / PAD ids, and the weights file says it is PyTorch's ("format":
    "pt", which transformers' from_pretrained requires). Idempotent; rewrites only what is missing."""
    from transformers import GenerationConfig

    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        return
    raw = json.loads(cfg_path.read_text())
    if not raw.get("architectures") and raw.get("model_type") in HF_ARCHITECTURES:
        raw["architectures"] = [HF_ARCHITECTURES[raw["model_type"]]]
        _replace_text(cfg_path, json.dumps(raw, indent=2, sort_keys=True) + "\n")
    if not (directory / "generation_config.json").is_file():
        ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if raw.get(k) is not None}
        _replace_text(directory / "generation_config.json", GenerationConfig(**ids).to_json_string(use_diff=True))
    weights = directory / "model.safetensors"
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            tagged = (f.metadata() or {}).get("format") == "pt"
        if not tagged:
            from safetensors.torch import load_file, save_file

            tmp = weights.with_name(weights.name + f".tmp{os.getpid()}")
            save_file(load_file(str(weights)), str(tmp), metadata={"format": "pt"})
            os.replace(tmp, weights)


def _replace_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all (another process may be reading the cached directory)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def resolve(model: str | os.PathLike, progress: bool = True) -> ResolvedModel:
    spec = str(model)
    known = hub.resolve_known(spec, progress=progress)
    if known is not None:
        return ResolvedModel(spec, convert_gguf(known, progress, weights=False), known)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return ResolvedModel(spec, convert_gguf(path, progress, weights=False), path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face model directory")
        return ResolvedModel(spec, path)
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise FileNotFoundError(
            f"model {spec!r} is neither a known model ({', '.join(hub.REGISTRY)}), a .gguf file, "
            "a Hugging Face directory, nor a hub id of the form org/name"
        )
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as e:
        raise FileNotFoundError(
            f"could not download {spec!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            "Without hub access, pass a local directory or a .gguf file with --model."
        ) from e
    return ResolvedModel(spec, Path(local))


def read_config(directory: Path) -> dict[str, Any]:
    cfg = json.loads((directory / "config.json").read_text())
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    return cfg


def tensor_index(directory: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor of the directory's *.safetensors files: the file holding it and its shape, read from the
    headers alone (no tensor data)."""
    from safetensors import safe_open

    out: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                out[name] = (f, tuple(sf.get_slice(name).get_shape()))
    return out


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights (other formats are not supported)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


def load_model(
    model: str | os.PathLike | ResolvedModel,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    max_len: int | None = None,
    progress: bool = True,
    quantization: str | None = None,
) -> tuple[LlamaModel, ResolvedModel]:
    """Build our decoder with the checkpoint's weights, cast to `dtype` on `device`.

    quantization="gguf" (a .gguf model, CPU, dtype bfloat16): the Q4_0 / Q4_1 linears run on the GGUF's own 4-bit
    blocks through aten's CPU int4 kernel; "gguf-q8act" (a .gguf model, CPU, float32 or bfloat16): the block-format
    linears and the output head run on the GGUF's own blocks through verispec's kernel with int8 activations
    (models/quantized.py), loaded straight from the file without a dense copy (models/gguf_direct.py; a file it
    cannot cover loads densely, then its linears are swapped); None: dense weights.
    """
    resolved = model if isinstance(model, ResolvedModel) else resolve(model, progress)
    _check_quantization(quantization, resolved, dtype, device)
    cfg = ModelConfig.from_hf(read_config(resolved.directory))
    # the positions its RoPE tables (and so its caches) cover: the context asked for, at most the model's own
    rope_len = min(max_len, cfg.max_position_embeddings) if max_len else cfg.max_position_embeddings
    if quantization == "gguf-q8act":
        from verispec.models.gguf_direct import load_q8act_direct

        light = load_q8act_direct(resolved.gguf, cfg, parse_dtype(dtype), rope_len)  # type: ignore[arg-type]
        if light is not None:
            log.info("quantization=gguf-q8act: loaded from the GGUF's blocks without a dense copy")
            return light, resolved
    with torch.device("meta"):
        net = LlamaModel(cfg, rope_len=1)
    net = net.to_empty(device="cpu")
    load_hf_state_dict(net, load_state_dict(with_weights(resolved).directory))
    net.set_rope_length(rope_len)
    net = net.to(device=device, dtype=parse_dtype(dtype))
    # .to(dtype) rounded the RoPE tables to the weights' dtype; they stay float32-typed (with those rounded values)
    net.rope_cos = net.rope_cos.float()
    net.rope_sin = net.rope_sin.float()
    if quantization == "gguf":
        from verispec.models.quantized import quantize_from_gguf

        replaced = quantize_from_gguf(net, resolved.gguf)  # type: ignore[arg-type]
        log.info("quantization=gguf: %d linears run on the GGUF's int4 blocks", replaced)
    elif quantization == "gguf-q8act":
        from verispec.models.quantized import quantize_q8act

        replaced = quantize_q8act(net, resolved.gguf)  # type: ignore[arg-type]
        log.info("quantization=gguf-q8act: %d linears (with the head) run on the GGUF's blocks", replaced)
    net.eval()
    return net, resolved




def gguf_has_int4_linears(resolved: ResolvedModel) -> bool:
    """Whether the model is a GGUF whose first layer's linears are Q4_0 / Q4_1 (what quantization="gguf" runs)."""
    if resolved.gguf is None:
        return False
    from verispec.models.gguf_index import GGUFIndex

    reader = GGUFIndex.open(resolved.gguf)
    names = [f"blk.0.{p}.weight" for p in ("attn_q", "attn_output", "ffn_gate", "ffn_down")]
    try:
        return all(reader.entry(n).kind in ("Q4_0", "Q4_1") for n in names)
    except KeyError:
        return False


def _check_quantization(quantization: str | None, resolved: ResolvedModel, dtype: str | torch.dtype,
                        device: str | torch.device) -> None:
    """Raise unless `quantization` is None, or "gguf" / "gguf-q8act" on a GGUF model, on CPU, in bfloat16 (gguf)
    or float32 / bfloat16 (gguf-q8act)."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)} or None")
    if resolved.gguf is None:
        raise ValueError(f"quantization={quantization!r} needs a .gguf model (or a known name); "
                         f"{resolved.name} is not one")
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs a CPU kernel: use device='cpu'")
    if quantization == "gguf-q8act":
        if parse_dtype(dtype) not in (torch.float32, torch.bfloat16):
            raise ValueError("quantization='gguf-q8act' takes float32 or bfloat16 activations")
        return
    if parse_dtype(dtype) != torch.bfloat16:
        raise ValueError("quantization='gguf' runs bfloat16 activations: use dtype='bfloat16'")


def load_tokenizer(resolved: ResolvedModel):
    """The checkpoint's tokenizer, or None when the directory has none (token-id prompts still work).

    A GGUF's converted directory holds the tokenizer transformers' AutoTokenizer made from the file, saved under its
    class's name (`_convert_config`): that class loads it directly. AutoTokenizer would first read the model's
    config, which imports the model family's modelling stack: for the default model (Llama) accelerate, sympy and
    the hub-kernels integration, about 700 modules and 54 MiB of the 111 MiB its tokenizer cost a process. Hub
    directories go through AutoTokenizer, whose corrections for mislabelled hub tokenizers they may need."""
    d = resolved.directory
    if not any((d / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")):
        return None
    saved = _saved_tokenizer_class(d) if resolved.gguf is not None else None
    if saved is not None:
        return saved.from_pretrained(str(d))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def _saved_tokenizer_class(directory: Path):
    """The tokenizer class a converted directory's tokenizer_config.json names, or None (none named, or unknown to
    this transformers)."""
    try:
        saved = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = saved.get("tokenizer_class") if isinstance(saved, dict) else None
    if not isinstance(name, str):
        return None
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    return tokenizer_class_from_name(name)
