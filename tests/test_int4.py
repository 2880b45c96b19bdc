"""kernels/int4.py: the CPU int4 kernel path, against gguf's own dequantisation and float64 matmuls.

(a) fp32 activations times the identity are gguf's dequantised weights bit for bit (Q4_0, Q4_1, fused parts);
(b) bf16 activations are within a stated tolerance of a float64 matmul with gguf's weights;
(c) batch invariance: a row's bf16 output is bitwise the same alone, in a block of 8 and among 16 random rows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from verispec.kernels.int4 import Int4Weight, int4_kernel_available
from verispec.models.gguf_blocks import Blocks, read_blocks, unpack

pytestmark = pytest.mark.skipif(not int4_kernel_available(),
                                reason=f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu")

# bf16 path: |y - y64| <= BF16_TOL * max |y64| per output. Sources: x already bf16 (exact in the reference), the
# scales and zeros rounded to bf16 (relative 2^-9 each), bf16 output rounding (2^-9). 2^-9 = 1.95e-3; the bound
# leaves room for the sum of K such terms partly cancelling (measured: 2.4e-3 .. 3.6e-3 at M = 1 .. 32); a wrong
# nibble or scale layout gives errors of O(1).
BF16_TOL = 1e-2


def _quantised(kind: str, n: int, k: int, seed: int) -> tuple[Blocks, np.ndarray]:
    """(Blocks, gguf's float32 dequantisation [N, K]) of a random weight quantised by gguf."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType[kind])
    return unpack(raw, kind), quants.dequantize(raw, GGMLQuantizationType[kind])


def _int4(blocks: Sequence[Blocks], dtype: torch.dtype) -> Int4Weight:
    return Int4Weight.from_q4([(b.q, b.scale, b.min) for b in blocks], dtype=dtype)


def _assert_identity_exact(w: Int4Weight, ref: np.ndarray) -> None:
    """fp32 activations: the identity through the kernel, and dequantized(), are `ref` bit for bit."""
    n, k = ref.shape
    got = w.matmul(torch.eye(k)).T.contiguous()  # [N, K] float32
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got, torch.from_numpy(ref)), f"max |diff| {(got - torch.from_numpy(ref)).abs().max()}"
    assert torch.equal(w.dequantized(), torch.from_numpy(ref))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_fp32_identity_is_gguf_dequant_bit_for_bit(kind: str) -> None:
    b, ref = _quantised(kind, 64, 160, seed=1)
    _assert_identity_exact(_int4([b], torch.float32), ref)


def test_fused_parts_stack_along_n() -> None:
    """q, k, v-like parts of different N and formats, fused: the rows of each part in order."""
    parts = [_quantised("Q4_1", 48, 96, 2), _quantised("Q4_0", 16, 96, 3), _quantised("Q4_1", 32, 96, 4)]
    w = _int4([b for b, _ in parts], torch.float32)
    assert w.shape == (96, 96)
    _assert_identity_exact(w, np.concatenate([r for _, r in parts]))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_bf16_matmul_close_to_float64(kind: str) -> None:
    b, ref = _quantised(kind, 96, 256, seed=5)
    w = _int4([b], torch.bfloat16)
    torch.manual_seed(0)
    for m in (1, 3, 8, 32):
        x = torch.randn(m, 256).bfloat16()
        y = w.matmul(x)  # [M, N]
        y64 = x.double() @ torch.from_numpy(ref).double().T  # [M, N]
        assert y.dtype == torch.bfloat16 and y.shape == (m, 96)
        err = (y.double() - y64).abs().max() / y64.abs().max()
        assert err <= BF16_TOL, f"M={m}: relative error {err:.2e} > {BF16_TOL}"


def test_bf16_rows_are_batch_invariant() -> None:
    b, _ = _quantised("Q4_1", 128, 576, seed=6)
    w = _int4([b], torch.bfloat16)
    torch.manual_seed(1)
    row = torch.randn(1, 576).bfloat16()
    alone = w.matmul(row)[0]  # [N]
    for m in (8, 16):
        for pos in (0, m // 2, m - 1):
            x = torch.randn(m, 576).bfloat16()
            x[pos] = row[0]
            assert torch.equal(w.matmul(x)[pos], alone), f"row {pos} of {m} differs from the row alone"
    block = row.repeat(8, 1)  # the same row 8 times
    assert all(torch.equal(r, alone) for r in w.matmul(block))


def test_bad_shapes_and_devices_raise() -> None:
    b, _ = _quantised("Q4_1", 16, 64, 7)
    with pytest.raises(ValueError, match="multiple of 32"):
        Int4Weight(torch.zeros(16, 48, dtype=torch.int32), torch.ones(16, 1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="N of 16"):
        Int4Weight(torch.zeros(8, 64, dtype=torch.int32), torch.ones(8, 2), torch.zeros(8, 2))
    with pytest.raises(ValueError, match="0..15"):
        Int4Weight(torch.full((16, 64), 16, dtype=torch.int32), torch.ones(16, 2), torch.zeros(16, 2))
    w = _int4([b], torch.bfloat16)
    with pytest.raises(ValueError, match="does not match"):
        w.matmul(torch.zeros(2, 32))
    with pytest.raises(NotImplementedError, match="CPU"):
        w.matmul(torch.zeros(2, 64, device="meta"))


@pytest.mark.slow
def test_default_model_tensor_fp32_identity_exact() -> None:
    from gguf import GGUFReader

    from verispec.models.hub import DEFAULT_MODEL
    from verispec.models.loader import resolve

    gguf_path = resolve(DEFAULT_MODEL, progress=False).gguf
    reader = GGUFReader(str(gguf_path))
    for name in ("blk.0.ffn_gate.weight", "blk.7.attn_output.weight"):
        t = next(t for t in reader.tensors if t.name == name)
        ref = quants.dequantize(t.data, t.tensor_type)  # [N, K]
        _assert_identity_exact(_int4([read_blocks(reader, name)], torch.float32), ref)
