"""Tensor-parallel slices of packed weights: each rank's part dequantizes to exactly its rows or
columns of the whole weight, in every format; a cut inside a block is refused by name."""

from __future__ import annotations

import pytest
import torch

from ds4_vllm.cli.cpu_parallel import cpu_thread_binding
from ds4_vllm.model.parallel import Split, TpGroup, take_part
from ds4_vllm.model.quant import QuantizedWeight, QuantType
from ds4_vllm.model.quant.dequant import dequantize
from ds4_vllm.model.quant.modules import QuantExperts, QuantLinear
from tests.model.quant_weights import random_fp8_weight, random_gguf_weight, random_mxfp4_weight

GGUF = [QuantType.Q8_0, QuantType.Q2_K, QuantType.Q4_K, QuantType.IQ2_XXS]


def weights(shape: tuple[int, ...]):
    for qtype in GGUF:
        yield qtype.value, random_gguf_weight(qtype, shape, seed=3)
    yield "FP8_BLOCK", random_fp8_weight(shape, seed=4)
    yield "MXFP4", random_mxfp4_weight(shape, seed=5)
    yield "float", torch.randn(shape, generator=torch.Generator().manual_seed(6))


def whole(w) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else dequantize(w, dtype=torch.float32)


@pytest.mark.parametrize(
    "name, weight", list(weights((256, 1024))), ids=lambda v: v if isinstance(v, str) else ""
)
@pytest.mark.parametrize("axis", [0, 1])
def test_each_rank_gets_exactly_its_part(name, weight, axis: int) -> None:
    full = whole(weight)
    pieces = []
    for rank in range(2):
        split = Split(axis, TpGroup(rank, 2).part(full.shape[axis], "test"), full.shape[axis])
        part = take_part(weight, split, name)
        assert tuple(part.shape) == split.local_shape(tuple(full.shape))
        pieces.append(whole(part))
    assert torch.equal(torch.cat(pieces, dim=axis), full)


@pytest.mark.parametrize(
    "name, weight", list(weights((4, 256, 512))), ids=lambda v: v if isinstance(v, str) else ""
)
def test_expert_parallel_stacks_keep_their_experts(name, weight) -> None:
    full = whole(weight)
    part = take_part(weight, Split(0, range(2, 4), 4), name)
    assert torch.equal(whole(part), full[2:4])


def test_a_cut_inside_a_block_is_refused_by_name() -> None:
    weight = random_gguf_weight(QuantType.Q2_K, (64, 512), seed=1)  # 2 blocks of 256 per row
    with pytest.raises(ValueError, match=r"layers\.0\.o_b.*Q2_K input columns 128\.\.256 of 512.*256-value"):
        take_part(weight, Split(1, range(128, 256), 512), "layers.0.o_b")


def test_a_size_that_does_not_divide_is_refused() -> None:
    with pytest.raises(
        ValueError, match="tensor parallel size 3 does not divide the number of output groups"
    ):
        TpGroup(0, 3).part(8, "the number of output groups")


def test_row_and_column_parallel_layers_add_up_to_the_whole() -> None:
    """A column-split layer then a row-split layer, summed over ranks, is the unsplit pair."""
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    up_w, down_w = torch.randn(128, 64), torch.randn(64, 128)
    up, down = QuantLinear(64, 128), QuantLinear(128, 64)
    up.set_weight(up_w)
    down.set_weight(down_w)
    total = torch.zeros(3, 64)
    for rank in range(2):
        part = TpGroup(rank, 2).part(128, "width")
        r_up, r_down = QuantLinear(64, 128, Split(0, part, 128)), QuantLinear(128, 64, Split(1, part, 128))
        r_up.set_weight(up_w)
        r_down.set_weight(down_w)
        total += r_down(r_up(x))
    torch.testing.assert_close(total, down(up(x)), rtol=1e-5, atol=1e-5)


def test_expert_parallel_ranks_add_up_to_all_experts() -> None:
    torch.manual_seed(1)
    n, hidden, ffn = 4, 32, 64
    gate, up, down = torch.randn(n, ffn, hidden), torch.randn(n, ffn, hidden), torch.randn(n, hidden, ffn)
    x = torch.randn(5, hidden)
    indices = torch.tensor([[0, 3], [1, 2], [3, 1], [2, 0], [0, 1]])
    weights_ = torch.rand(5, 2)

    def experts(owned: range | None) -> QuantExperts:
        e = QuantExperts(n, hidden, ffn, limit=7.0, experts=owned)
        for proj, w in ((e.gate_proj, gate), (e.up_proj, up), (e.down_proj, down)):
            proj.set_weight(w)
        return e

    everything = experts(None)
    for batch in (slice(0, 5), slice(0, 1)):  # the general path and the one-token decode path
        ranks = sum(
            experts(TpGroup(r, 2).part(n, "experts"))(x[batch], indices[batch], weights_[batch])
            for r in range(2)
        )
        torch.testing.assert_close(
            ranks, everything(x[batch], indices[batch], weights_[batch]), rtol=1e-5, atol=1e-5
        )


def test_cpu_binding_gives_each_rank_its_own_cores() -> None:
    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, list(range(8))) == "0,1,2,3|4,5,6,7"
    with pytest.raises(ValueError, match="needs at least 4 CPU cores"):
        cpu_thread_binding(4, [0, 1])


def test_a_memory_mapped_part_stays_a_view_of_the_map() -> None:
    """A GGUF stack's rows for this rank are not copied: the pages stay the page cache's (shared by
    the ranks, and the other ranks' rows are never read)."""
    w = random_gguf_weight(QuantType.Q2_K, (4, 64, 256), seed=2)
    mapped = QuantizedWeight(w.qtype, w.shape, w.data, mapped=True)
    part = take_part(mapped, Split(0, range(2, 4), 4), "experts")
    assert part.mapped and part.data.data_ptr() == mapped.data[2].data_ptr()
    copied = take_part(w, Split(0, range(2, 4), 4), "experts")
    assert not copied.mapped and copied.data.data_ptr() != w.data[2].data_ptr()
    assert torch.equal(whole(part), whole(copied))
