"""Batch invariance measured on the loaded weights (execution/invariance.py) and what the engine does with it:
per-query attention where the linears pass, an error where `invariant=True` is asked of a path that fails, and
bitwise speculative == plain greedy output on a dense bf16 path (which diverged at near-ties before)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from verispec.execution.invariance import rows_invariant


class RowByRow(nn.Module):
    """x W^T computed one row at a time: invariant by construction."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = w
        self.shape = w.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[i : i + 1] @ self.w.T for i in range(x.shape[0])])


class BatchScaled(RowByRow):
    """Rows scaled by a statistic of the whole batch, like a per-tensor activation scale: not invariant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax() / 127
        return (torch.round(x / scale) * scale) @ self.w.T


def test_the_check_passes_a_row_by_row_product_and_fails_a_per_tensor_scale():
    w = torch.randn(24, 32)
    assert rows_invariant(RowByRow(w), 32, torch.float32, torch.device("cpu"))
    assert not rows_invariant(BatchScaled(w), 32, torch.float32, torch.device("cpu"))


def _plain_and_spec(tiny_dir, dtype, invariant=None, prompts=4):
    from verispec import LLM, SamplingParams

    base = LLM(str(tiny_dir), dtype=dtype, device="cpu", progress=False, max_num_seqs=1, invariant=invariant)
    # the target drafting for itself: every step verifies a full block of 5 drafts
    spec = base.with_speculation({"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 4,
                                  "adaptive": False})
    torch.manual_seed(0)
    outs = []
    for _ in range(prompts):
        ids = torch.randint(3, 200, (12,)).tolist()
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        a = base.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0]
        b = spec.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0]
        outs.append((a.token_ids, b.token_ids, b.stats))
    return base, outs


def _torch_bf16_gemm_rounds_rows_by_batch(llm) -> bool:
    """Independent of execution/invariance.py: does torch's own bf16 F.linear give some row of the model's weights
    other bits in a block of 8 than alone? CPUs differ: with AVX-512 bf16 or AMX (and on the AVX2 machines seen so
    far) it did not; on an Ice Lake server (AVX-512 without bf16) the head's GEMM did."""
    g = torch.Generator().manual_seed(3)
    head = getattr(llm.model, "head_weight", None)
    weights = [p for n, p in llm.model.named_parameters() if p.dim() == 2 and "embed" not in n]
    for w in weights + [head if head is not None else llm.model.output_weight()]:
        x = torch.randn(8, w.shape[1], generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            block = torch.nn.functional.linear(x, w)
            alone = torch.cat([torch.nn.functional.linear(x[i : i + 1], w) for i in range(8)])
        if not torch.equal(block, alone):
            return True
    return False


def test_dense_bf16_measures_invariance_and_speculative_greedy_equals_plain_bitwise_where_it_holds(tiny_dir):
    base, outs = _plain_and_spec(tiny_dir, "bfloat16")
    assert sum(s["num_draft_tokens"] for _, _, s in outs) > 0  # blocks of more than one token were verified
    if _torch_bf16_gemm_rounds_rows_by_batch(base):
        # the engine must not claim what this CPU's GEMM does not give, and must refuse to promise it
        assert not all(base.linear_invariance.values()) and base.model.batch_invariant is False
        assert all(stats["batch_invariant"] is False for _, _, stats in outs)
        from verispec import LLM
        with pytest.raises(ValueError, match="round a row differently by batch size"):
            LLM(str(tiny_dir), dtype="bfloat16", device="cpu", progress=False, max_num_seqs=1, invariant=True)
        return
    assert all(base.linear_invariance.values()) and base.model.batch_invariant
    for plain, spec, stats in outs:
        assert spec == plain and stats["batch_invariant"] is True


def _block_and_steps(model, ids, n):
    """Logits [n, V] of the last n tokens of `ids` verified as one block, and computed one decode step at a time."""
    from verispec.models.llama import Segment

    cache = model.new_cache(len(ids))
    slot = cache.allocate()
    model.prefill(ids[:-n], cache, slot)
    start = len(ids) - n
    block = model(torch.tensor(ids[-n:]), [Segment(slot, start, n)], cache, logits_indices=range(n)).logits
    cache.rollback(slot, start)
    steps = []
    for i in range(n):
        steps.append(model(torch.tensor([ids[start + i]]), [Segment(slot, start + i, 1)], cache).logits)
        cache.commit(slot, 1)
    return block, torch.cat(steps)


def test_a_tokens_logits_are_bitwise_the_same_in_a_block_as_alone_on_dense_bf16(tiny_dir):
    from verispec import LLM

    llm = LLM(str(tiny_dir), dtype="bfloat16", device="cpu", progress=False, max_num_seqs=1)
    if _torch_bf16_gemm_rounds_rows_by_batch(llm):
        pytest.skip("torch's bf16 GEMM rounds rows by batch size on this CPU (measured): dense bf16 is not invariant")
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    block, steps = _block_and_steps(llm.model, ids, 8)
    assert llm.model.batch_invariant
    assert torch.equal(block, steps), f"max |diff| {(block - steps).abs().max():.3g}"


def test_invariant_is_refused_where_the_linears_round_by_batch_size_and_can_be_turned_off(tiny_dir):
    from verispec import LLM

    fp32 = LLM(str(tiny_dir), dtype="float32", device="cpu", progress=False, max_num_seqs=1)
    if all(fp32.linear_invariance.values()):
        pytest.skip("this machine's fp32 GEMM happens to be row-invariant at these shapes")
    assert fp32.model.batch_invariant is False
    with pytest.raises(ValueError, match="round a row differently by batch size"):
        LLM(str(tiny_dir), dtype="float32", device="cpu", progress=False, max_num_seqs=1, invariant=True)
    off = LLM(str(tiny_dir), dtype="bfloat16", device="cpu", progress=False, max_num_seqs=1, invariant=False)
    assert off.model.batch_invariant is False
