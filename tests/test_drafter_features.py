"""How a drafter's features are taken from a forward and kept: `take` slices the forward's side-by-side capture
buffer (or concatenates the layers' states when there is none), `own` keeps a tensor as is only where nothing else
shares its storage, so a drafter waiting to use its rows never holds a whole step's rows alive."""

from __future__ import annotations

import torch

from verispec.execution.features import own, take
from verispec.models.llama import ForwardOutput

D = 4


def forward_output(rows: int, packed: bool) -> tuple[ForwardOutput, dict[int, torch.Tensor]]:
    """A forward's capture of layers 1 and 3 over `rows` rows, with or without the side-by-side buffer; and the
    states by layer built independently (what the concatenation must give)."""
    ref = {1: torch.randn(rows, D), 3: torch.randn(rows, D)}
    if not packed:
        return ForwardOutput(logits=torch.zeros(0, 1), hidden=dict(ref)), ref
    buf = torch.empty(rows, 2 * D)
    buf[:, :D], buf[:, D:] = ref[1], ref[3]
    hidden = {1: buf[:, :D], 3: buf[:, D:]}
    return ForwardOutput(logits=torch.zeros(0, 1), hidden=hidden, packed=buf, packed_layers=(1, 3)), ref


def test_take_is_the_concatenation_with_or_without_the_buffer() -> None:
    for packed in (True, False):
        out, ref = forward_output(5, packed)
        for rows in (slice(1, 3), torch.tensor([4, 0])):
            want = torch.cat([ref[1][rows], ref[3][rows]], dim=-1)
            assert torch.equal(take(out, (1, 3), rows), want)
        # layers in another order, or a subset: not the buffer's columns, so concatenated in the asked order
        assert torch.equal(take(out, (3, 1), slice(0, 2)), torch.cat([ref[3][:2], ref[1][:2]], dim=-1))
        assert torch.equal(take(out, (3,), slice(0, 2)), ref[3][:2])


def test_take_of_a_slice_is_a_view_of_the_buffer() -> None:
    out, _ = forward_output(5, True)
    got = take(out, (1, 3), slice(1, 3))
    assert out.packed is not None and got.untyped_storage().data_ptr() == out.packed.untyped_storage().data_ptr()


def test_own_keeps_a_tensor_that_is_its_whole_storage_and_copies_a_view_of_a_bigger_one() -> None:
    out, ref = forward_output(5, True)
    cpu = torch.device("cpu")
    view = take(out, (1, 3), slice(2, 3))  # one row of a five-row step
    kept = own(view, cpu)
    assert torch.equal(kept, view)
    assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()  # not the step's five rows
    out.packed.zero_()  # type: ignore[union-attr]  # the step's buffer changing does not reach the kept copy
    assert torch.equal(kept, torch.cat([ref[1][2:3], ref[3][2:3]], dim=-1))

    one, _ = forward_output(1, True)  # a one-row step: its buffer is the row, kept as is
    whole = take(one, (1, 3), slice(0, 1))
    assert own(whole, cpu) is whole
    fresh = torch.randn(3, 2 * D)
    assert own(fresh, cpu) is fresh
    half = own(fresh, cpu, torch.bfloat16)  # another dtype: converted
    assert half.dtype is torch.bfloat16 and torch.equal(half, fresh.to(torch.bfloat16))
