"""The gguf-q8act path's light load (models/gguf_direct.py) and its embedding (models/gguf_embedding.py), on tiny
GGUF files written with gguf's writer (bench/synth_gguf.py's layout):

- logits equal, bit for bit, those of the path it replaces: the dense load (transformers' GGUF reader) with the
  linears then swapped for the file's blocks (`quantize_q8act`): arch llama (q / k rows permuted, untied head),
  qwen2 (q / k / v biases, tied head), qwen3 (q / k norms), and a mixed file (K-quant and 5-bit linears, an F16
  part that keeps its fused qkv dense, rows un-permuted as transformers does, a Q6_K tied embedding);
- embedding rows equal gguf's own `gguf.quants.dequantize` of those rows (read by gguf's `GGUFReader`), held or
  read from the file, and the dense table a drafter asks for equals the dense load's;
- the light model holds no dense [V, d] or [N, K] linear: its parameters and buffers weigh less than the file;
- a file it cannot cover loads through the dense path, said on stderr.
Loads need verispec's CPU kernel (a C compiler); the embedding's tests run without one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from verispec.bench.synth_gguf import write_gguf
from verispec.kernels.cpu_build import KernelUnavailable
from verispec.models.gguf_embedding import GGUFEmbedding

try:
    from verispec.kernels.cpu_kernels import load

    load()
    HAVE_KERNEL = True
except KernelUnavailable:
    HAVE_KERNEL = False
needs_kernel = pytest.mark.skipif(not HAVE_KERNEL, reason="verispec's CPU kernel cannot be built here")

BASE = dict(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
CFGS = {"llama-untied": dict(BASE, model_type="llama", tie_word_embeddings=False),
        "qwen2-tied": dict(BASE, model_type="qwen2", tie_word_embeddings=True),
        "qwen3-tied": dict(BASE, model_type="qwen3", tie_word_embeddings=True, head_dim=128)}
# the mixed file: tensor kind (blk.N.<kind>.weight or a global) -> format; K-quants as random valid blocks
MIXED = {"attn_q": "Q4_K", "attn_k": "F16", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q6_K"}
SIZES = {"Q4_K": (256, 144), "Q6_K": (256, 210)}
SCALE_AT = {"Q4_K": (0, 2), "Q6_K": (208,)}  # byte offsets of each block's fp16 scales


def random_kquant(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [N, K / 256 * bytes]: random bytes with small finite fp16 scales (a valid block of `kind`)."""
    elems, size = SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for at in SCALE_AT[kind]:
        raw[:, :, at : at + 2] = rng.uniform(2e-5, 2e-4, (n, k // elems, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def requantised(src, dst, formats: dict[str, str]) -> None:
    """The GGUF `src` rewritten to `dst` with each matrix in formats[its kind] (gguf's quantizer, or random valid
    K-quant blocks); 1-D tensors and metadata as they were."""
    reader = GGUFReader(str(src))
    w = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for i, t in enumerate(reader.tensors):
        data = np.asarray(t.data)
        if len(t.shape) != 2:
            w.add_tensor(t.name, data)
            continue
        fmt = formats[t.name.split(".")[-2]]
        n, k = int(t.shape[1]), int(t.shape[0])
        dense = dequantize(data, GGMLQuantizationType(t.tensor_type)).reshape(n, k)
        if fmt == "F16":
            w.add_tensor(t.name, dense.astype(np.float16))
        else:
            raw = random_kquant(fmt, n, k, i) if fmt in SIZES else quantize(dense, GGMLQuantizationType[fmt])
            w.add_tensor(t.name, raw, raw_dtype=GGMLQuantizationType[fmt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> a tiny GGUF: each of CFGS in Q8_0 (norms and biases float32, as llama.cpp writes them), and the
    mixed llama file."""
    d = tmp_path_factory.mktemp("direct")
    out = {name: write_gguf(d / f"{name}.gguf", cfg, float_type="q8_0", seed=i)
           for i, (name, cfg) in enumerate(CFGS.items())}
    f32 = write_gguf(d / "mixed-f32.gguf", dict(BASE, model_type="llama", tie_word_embeddings=True),
                     float_type="f32", seed=7)
    requantised(f32, d / "mixed.gguf", MIXED)
    out["mixed-tied"] = d / "mixed.gguf"
    return out


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Every row's logits over a prefill and then blocks as decode and verification run them."""
    from verispec.models.llama import Segment

    cache = model.new_cache(64)
    slot = cache.allocate()
    got, start = [], 0
    for n in (9, 1, 4, 1):
        got.append(model(ids[start : start + n], [Segment(slot, start, n)], cache, logits_indices=range(n)).logits)
        cache.commit(slot, n)
        start += n
    return torch.cat(got)


def _loads(path, dtype: str = "float32"):
    """(the light load, the dense load with its linears swapped by `quantize_q8act`)."""
    from verispec.models.loader import load_model
    from verispec.models.quantized import quantize_q8act

    light, _ = load_model(str(path), dtype=dtype, quantization="gguf-q8act", progress=False)
    ref, _ = load_model(str(path), dtype=dtype, progress=False)
    quantize_q8act(ref, path)
    return light, ref


@needs_kernel
@pytest.mark.parametrize("name", [*CFGS, "mixed-tied"])
def test_light_load_logits_are_the_dense_then_swapped_loads_bit_for_bit(files, name) -> None:
    light, ref = _loads(files[name])
    assert light.embedding is not None and "embed" not in light._parameters  # the light path was taken
    ids = torch.randint(0, BASE["vocab_size"], (15,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(_logits(light, ids), _logits(ref, ids))
    for ours, theirs in zip(light.layers, ref.layers):
        for fused in ("qkv", "o", "gate_up", "down"):
            a, b = getattr(ours, fused), getattr(theirs, fused)
            assert type(a) is type(b), fused
            if isinstance(a, torch.nn.Parameter):  # a part without a body (the mixed file's F16 k): qkv dense
                assert torch.equal(a, b), fused
    assert torch.equal(light.embed, ref.embed)  # built on first access, for a drafter
    if not light.cfg.tie_word_embeddings:
        assert torch.equal(light.lm_head, ref.lm_head)


@needs_kernel
def test_bfloat16_activations_match_too(files) -> None:
    light, ref = _loads(files["qwen2-tied"], "bfloat16")
    assert light.dtype == ref.dtype == torch.bfloat16
    ids = torch.tensor([5, 17, 3, 88, 41, 0, 95, 12, 60, 7, 33, 21, 2, 9, 50])
    with torch.inference_mode():
        assert torch.equal(_logits(light, ids), _logits(ref, ids))


@needs_kernel
@pytest.mark.parametrize("name", ["llama-untied", "mixed-tied"])
def test_the_light_model_holds_no_dense_table_or_linear(files, name) -> None:
    from verispec.models.loader import load_model

    path = files[name]
    light, _ = load_model(str(path), dtype="float32", quantization="gguf-q8act", progress=False)
    c = light.cfg
    held = [(n, t) for n, t in [*light.named_parameters(), *light.named_buffers()] if not n.startswith("rope")]
    big = [n for n, t in held if t.is_floating_point() and t.dim() == 2]
    dense_o = [f"layers.{i}.qkv" for i in range(c.num_layers)] if name == "mixed-tied" else []
    assert big == dense_o  # only the linear with an F16 part (no kernel body) is a float matrix
    floats = sum(t.nbytes for n, t in held if t.is_floating_point() and n not in dense_o)
    assert floats <= 4 * (c.num_layers * (4 * c.hidden_size + 6 * c.head_dim * c.num_heads) + c.hidden_size)
    total = sum(t.nbytes for n, t in held if n not in dense_o)  # the dense qkv: float32 here, more than its bytes
    assert total <= 1.1 * path.stat().st_size, (total, path.stat().st_size)  # repacked K-quants: x1.06 at most


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_rows_are_ggufs_dequantisation(files, tmp_path, tied) -> None:
    """Held rows (untied) and rows read from the file (tied): gguf's dequantisation of those rows from its own
    reader, then rounded to the model's dtype; the dense table likewise."""
    path = files["mixed-tied"]
    reader = GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    v, d = int(t.shape[1]), int(t.shape[0])
    want = dequantize(np.asarray(t.data), GGMLQuantizationType.Q6_K).reshape(v, d)
    raw = np.asarray(t.data).reshape(v, -1)
    for dtype in (torch.float32, torch.bfloat16):
        emb = (GGUFEmbedding.from_file(path, int(t.data_offset), "Q6_K", v, d, raw.shape[1], dtype) if tied
               else GGUFEmbedding.held(raw.copy(), "Q6_K", d, dtype))
        ids = torch.tensor([3, 95, 0, 3, 41, 42, 43])
        got = emb(ids)
        assert got.dtype == dtype and torch.equal(got, torch.from_numpy(want[ids.numpy()]).to(dtype))
        assert torch.equal(emb.dense(), torch.from_numpy(want).to(dtype))
    with pytest.raises(IndexError):
        emb(torch.tensor([v]))


def test_kept_rows_are_the_dequantised_rows_through_eviction(files, monkeypatch) -> None:
    """Decode-sized lookups go through the kept rows: with room for only 3 rows, a random walk of repeated and new
    ids (singly and a few at once, duplicates included) still returns gguf's dequantisation of every row."""
    import verispec.models.gguf_embedding as ge

    path = files["mixed-tied"]
    reader = GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    v, d = int(t.shape[1]), int(t.shape[0])
    want = torch.from_numpy(dequantize(np.asarray(t.data), GGMLQuantizationType.Q6_K).reshape(v, d))
    monkeypatch.setattr(ge, "CACHE_BYTES", 3 * d * 4)
    emb = GGUFEmbedding.from_file(path, int(t.data_offset), "Q6_K", v, d, np.asarray(t.data).reshape(v, -1).shape[1],
                                  torch.float32)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        ids = torch.randint(0, 8, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
        assert torch.equal(emb(ids), want[ids]), ids.tolist()
    assert len(emb._kept) <= 3
    assert torch.equal(emb(torch.arange(40)), want[:40])  # past CACHED_LOOKUP: straight through


@needs_kernel
def test_a_file_it_cannot_cover_loads_densely_and_says_so(files, tmp_path, capsys) -> None:
    """A config that does not match the file's shapes (a lie in config.json): the light load declines, the dense
    path takes the model and reports the mismatch as it always did."""
    from verispec.models.gguf_direct import load_q8act_direct
    from verispec.models.loader import ModelConfig, read_config, resolve

    path = files["qwen2-tied"]
    cfg = ModelConfig.from_hf(read_config(resolve(str(path), progress=False).directory))
    wrong = ModelConfig.from_hf({**read_config(resolve(str(path), progress=False).directory), "vocab_size": 97})
    assert load_q8act_direct(path, cfg, torch.float32, 64) is not None
    assert load_q8act_direct(path, wrong, torch.float32, 64) is None
    assert "cannot cover this file" in capsys.readouterr().err


@needs_kernel
def test_a_head_repacked_from_file_rows_is_the_head_repacked_whole(files, monkeypatch) -> None:
    """The head is repacked from the file some rows at a time (never its whole raw bytes and its tiles in memory
    together): the tiles equal those packed from gguf's own reading of the whole tensor, pieces of any size."""
    from verispec.kernels import q8act
    from verispec.kernels.q8act import Q8ActWeight
    from verispec.models.gguf_index import GGUFIndex

    path = files["mixed-tied"]
    name = "token_embd.weight"
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    whole = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # gguf's reader: [V, bytes per row]
    kind = GGMLQuantizationType(t.tensor_type).name
    ref = Q8ActWeight(whole, kind, whole.shape[0], int(t.shape[0]))
    monkeypatch.setattr(q8act, "PACK_ROWS", 24)  # pieces of 3 tiles, the last one short
    rows = GGUFIndex.open(path).row_source(name)
    assert rows.shape == whole.shape and np.array_equal(rows.rows(5, 9), whole[5:9])
    got = Q8ActWeight(rows, kind, whole.shape[0], int(t.shape[0]))
    assert torch.equal(got.tiles, ref.tiles) and torch.equal(got.layout, ref.layout)


@needs_kernel
def test_hf_directory_has_the_dense_weights_the_light_load_skips(files, tmp_path, monkeypatch) -> None:
    """The light load writes only config and tokenizer into the converted directory; `hf_directory` (what the
    exports guide hands llama.cpp's converter as --target-model-dir) adds the dense weights, which equal gguf's
    dequantisation of the file."""
    from safetensors.torch import load_file

    from verispec.models.loader import hf_directory, load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))  # a fresh cache: nothing converted before
    path = files["qwen2-tied"]
    _, resolved = load_model(str(path), dtype="float32", quantization="gguf-q8act", progress=False)
    assert not list(resolved.directory.glob("*.safetensors"))
    d = hf_directory(str(path))
    assert d == resolved.directory and (d / "model.safetensors").is_file() and (d / "config.json").is_file()
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == "output_norm.weight")
    assert torch.equal(load_file(str(d / "model.safetensors"))["model.norm.weight"],
                       torch.from_numpy(dequantize(t.data, GGMLQuantizationType(t.tensor_type)).copy()))


def test_converted_directories_of_gone_or_changed_files_are_pruned(files, tmp_path, monkeypatch) -> None:
    """A new conversion removes the cached directories whose GGUF was deleted or rewritten since (nothing can ask
    for them again); the directories of files still there, the new one and one another process is still writing
    stay."""
    import os
    import shutil

    from pathlib import Path

    from verispec.models.loader import convert_gguf

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    kept, gone, changed = (shutil.copy(files["qwen2-tied"], tmp_path / f"{n}.gguf") for n in ("kept", "gone",
                                                                                                  "changed"))
    dirs = {p: convert_gguf(Path(p), progress=False, weights=False) for p in (kept, gone, changed)}
    assert all(d.is_dir() for d in dirs.values())
    writing = dirs[kept].with_name(dirs[kept].name + ".tmp99")  # another process's conversion, not yet renamed
    shutil.copytree(dirs[gone], writing)
    os.remove(gone)
    st = os.stat(changed)
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place: another file id
    new = convert_gguf(Path(changed), progress=False, weights=False)
    assert new != dirs[changed] and new.is_dir()
    assert not dirs[gone].exists() and not dirs[changed].exists()
    assert dirs[kept].is_dir() and (dirs[kept] / "config.json").is_file() and writing.is_dir()
