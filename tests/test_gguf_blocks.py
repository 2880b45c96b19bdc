"""models/gguf_blocks.py against gguf's own reference dequantisation (`gguf.quants.dequantize`), bit for bit:
synthetic tensors quantised with `gguf.quants.quantize` (with and without a GGUF file around them), and the real
default-model GGUF (slow)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from verispec.models.gguf_blocks import Blocks, read_blocks, tensor_kind, unpack

KINDS = ["Q4_0", "Q4_1", "Q8_0"]


def _weights(n: int, k: int, seed: int = 0) -> np.ndarray:
    """[N, K] float32 with per-row offsets, so Q4_1's mins matter."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32),
                                                                                         b.view(np.uint32))


@pytest.mark.parametrize("kind", KINDS)
def test_unpack_then_dequantize_is_gguf_bit_for_bit(kind: str) -> None:
    n, k = 48, 96  # not square, three blocks per row
    raw = quants.quantize(_weights(n, k), GGMLQuantizationType[kind])  # uint8 [N, 3 * bytes per block]
    blocks = unpack(raw, kind)
    ref = quants.dequantize(raw, GGMLQuantizationType[kind])  # [N, K] float32
    assert blocks.shape == (n, k) and blocks.scale.shape == (n, k // 32)
    assert _bits_equal(blocks.dequantize(), ref)
    if kind == "Q8_0":
        assert blocks.q.dtype == np.int8
    else:
        assert blocks.q.dtype == np.uint8 and blocks.q.max() <= 15
        assert (blocks.min is not None) == (kind == "Q4_1")


def test_nibble_order_low_nibbles_first() -> None:
    """One hand-built Q4_0 block: bytes 0x10 + j (low nibble j mod 16, high nibble 1)."""
    raw = np.zeros((1, 18), np.uint8)
    raw[0, 0:2] = np.array([1.0], np.float16).view(np.uint8)  # d = 1
    raw[0, 2:] = 0x10 + np.arange(16, dtype=np.uint8)
    b = unpack(raw, "Q4_0")
    assert b.q[0].tolist() == list(range(16)) + [1] * 16
    assert b.dequantize()[0].tolist() == [float(j - 8) for j in range(16)] + [-7.0] * 16


def test_take_rows_matches_dequantized_rows() -> None:
    raw = quants.quantize(_weights(32, 64, seed=3), GGMLQuantizationType.Q4_1)
    rows = np.random.default_rng(0).permutation(32)
    ref = quants.dequantize(raw, GGMLQuantizationType.Q4_1)[rows]
    assert _bits_equal(unpack(raw, "Q4_1").take_rows(rows).dequantize(), ref)


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        unpack(np.zeros((2, 20), np.uint8), "Q5_K")
    with pytest.raises(ValueError, match="whole 20-byte blocks"):
        unpack(np.zeros((2, 30), np.uint8), "Q4_1")


def test_read_blocks_from_a_written_gguf_file(tmp_path) -> None:
    """A GGUF written by gguf's own writer: read_blocks must give the [N, K] layout (GGUF stores ne = [K, N])."""
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    data = {}
    for i, kind in enumerate(KINDS):
        raw = quants.quantize(_weights(16 * (i + 1), 64 * (3 - i), seed=i), GGMLQuantizationType[kind])
        data[kind] = raw
        w.add_tensor(f"w.{kind}", raw, raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for kind, raw in data.items():
        ref = quants.dequantize(raw, GGMLQuantizationType[kind])
        b = read_blocks(path, f"w.{kind}")
        assert b.kind == kind == tensor_kind(GGUFReader(str(path)), f"w.{kind}")
        assert _bits_equal(b.dequantize(), ref)
    with pytest.raises(KeyError):
        read_blocks(path, "missing")
    _check_index(path, tmp_path / "cache")


def _check_index(path, cache) -> None:
    """The cached tensor table gives gguf's own view of every tensor, and a second process reads it from disk."""
    from verispec.models import gguf_index
    from verispec.models.gguf_index import GGUFIndex

    reader = GGUFReader(str(path))
    index = GGUFIndex.open(path, cache=cache)
    assert index.arch == "llama" and set(index.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        assert index.entry(t.name).kind == GGMLQuantizationType(t.tensor_type).name
        assert index.entry(t.name).shape == tuple(int(x) for x in t.shape)
        assert np.array_equal(index.data(t.name), np.asarray(t.data).reshape(-1).view(np.uint8))
    gguf_index._open.cache_clear()  # as a new process would: from the JSON, never parsing the file again
    real_parse = gguf_index._parse
    gguf_index._parse = lambda p: pytest.fail("parsed the file although its index was cached")
    try:
        again = GGUFIndex.open(path, cache=cache)
    finally:
        gguf_index._parse = real_parse
    assert again == index


# ---- the real default-model GGUF ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_reader():
    from verispec.models.hub import DEFAULT_MODEL
    from verispec.models.loader import resolve

    gguf_path = resolve(DEFAULT_MODEL, progress=False).gguf
    assert gguf_path is not None
    return GGUFReader(str(gguf_path))


def _check_real(reader, name: str, kind: str, shape: tuple[int, int]) -> Blocks:
    t = next(t for t in reader.tensors if t.name == name)
    b = read_blocks(reader, name)
    assert b.kind == kind and b.shape == shape
    assert _bits_equal(b.dequantize(), quants.dequantize(t.data, t.tensor_type).reshape(shape))
    return b


@pytest.mark.slow
def test_default_model_q4_1_linear(default_reader) -> None:
    _check_real(default_reader, "blk.0.ffn_down.weight", "Q4_1", (576, 1536))  # [out, in], not square
    _check_real(default_reader, "blk.29.attn_k.weight", "Q4_1", (192, 576))


@pytest.mark.slow
def test_default_model_q8_0_embedding(default_reader) -> None:
    _check_real(default_reader, "token_embd.weight", "Q8_0", (49152, 576))
