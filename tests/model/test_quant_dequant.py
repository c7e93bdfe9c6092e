"""Dequantization is bit-identical to the references: gguf-py for GGUF, transformers for FP8/MXFP4."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from ds4_vllm.model.quant import QuantizedWeight, QuantType, block_layout, packed_shape
from ds4_vllm.model.quant.dequant import dequantize, e8m0_to_float
from tests.model.quant_weights import (
    finite_gguf_blocks,
    random_fp8_weight,
    random_gguf_weight,
    random_mxfp4_weight,
)

GGUF_TYPES = [QuantType.Q8_0, QuantType.Q2_K, QuantType.Q4_K, QuantType.IQ2_XXS]


def gguf_reference(weight: QuantizedWeight) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(weight.data.numpy(), GGMLQuantizationType[weight.qtype.value]))


def transformers_reference(weight: QuantizedWeight) -> torch.Tensor:
    """transformers 5.19's own dequantization of one [out, in] FP8-block or MXFP4 weight.

    It requires out and in to be whole multiples of the scale grid, so a ragged FP8 weight is
    zero-padded to full 128x128 blocks first and the result cropped back.
    """
    out_dim, in_dim = weight.shape
    data = weight.data
    if weight.qtype is QuantType.FP8_BLOCK:
        rows, cols = weight.scale.shape[0] * 128, weight.scale.shape[1] * 128
        padded = torch.zeros(rows, cols, dtype=torch.uint8)
        padded[:out_dim, :in_dim] = data
        data = padded.view(torch.float8_e4m3fn)
    else:
        data = data.view(torch.int8)
    full = Fp8Dequantize(None)._dequantize_one(data, weight.scale, output_dtype=torch.float32)
    return full[:out_dim, :in_dim]


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.value)
@pytest.mark.parametrize("shape", [(3, 512), (2, 4, 1024)])
def test_gguf_types_match_gguf_py_bit_for_bit(qtype: QuantType, shape: tuple[int, ...]) -> None:
    weight = random_gguf_weight(qtype, shape, seed=len(shape))
    ours = dequantize(weight)
    assert ours.shape == shape and ours.dtype == torch.float32
    assert torch.equal(ours, gguf_reference(weight).reshape(shape))


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.value)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_gguf_types_match_gguf_py_on_arbitrary_blocks(qtype: QuantType, data: st.DataObject) -> None:
    per_block, nbytes = block_layout(qtype)
    n_blocks = data.draw(st.integers(1, 6))
    raw = data.draw(st.binary(min_size=n_blocks * nbytes, max_size=n_blocks * nbytes))
    blocks = finite_gguf_blocks(np.frombuffer(raw, dtype=np.uint8).copy(), qtype)
    weight = QuantizedWeight.from_buffer(qtype, (n_blocks * per_block,), torch.from_numpy(blocks))
    assert torch.equal(dequantize(weight), gguf_reference(weight))


@pytest.mark.parametrize("qtype", [QuantType.F32, QuantType.F16, QuantType.BF16], ids=lambda t: t.value)
def test_plain_float_types_are_their_bytes(qtype: QuantType) -> None:
    torch_dtype = {QuantType.F32: torch.float32, QuantType.F16: torch.float16, QuantType.BF16: torch.bfloat16}
    bits = torch.from_numpy(
        np.random.default_rng(5).integers(0, 256, size=packed_shape(qtype, (6, 64)), dtype=np.uint8)
    )
    values = bits.view(torch_dtype[qtype])
    bits.view(torch_dtype[qtype])[values.isnan()] = 1.0  # NaN payloads compare unequal; keep +-inf
    weight = QuantizedWeight(qtype, (6, 64), bits)
    reference = torch.from_numpy(gguf_dequantize(bits.numpy(), GGMLQuantizationType[qtype.value])).reshape(
        6, 64
    )
    assert torch.equal(dequantize(weight), reference)
    assert dequantize(weight, dtype=torch_dtype[qtype]).data_ptr() == bits.data_ptr()  # no copy


@pytest.mark.parametrize(
    "shape", [(256, 384), (128, 128), (200, 300), (130, 131)], ids=["blocks", "one-block", "ragged", "odd-in"]
)
def test_fp8_block_matches_transformers_bit_for_bit(shape: tuple[int, int]) -> None:
    weight = random_fp8_weight(shape, seed=shape[0])
    ours = dequantize(weight)
    assert ours.shape == shape
    assert torch.equal(ours, transformers_reference(weight))


@pytest.mark.parametrize("shape", [(64, 256), (7, 32)])
def test_mxfp4_matches_transformers_bit_for_bit(shape: tuple[int, int]) -> None:
    weight = random_mxfp4_weight(shape, seed=shape[0])
    assert torch.equal(dequantize(weight), transformers_reference(weight))


def test_mxfp4_low_nibble_is_the_even_column() -> None:
    # byte 0x92: low nibble 2 (+1.0) at column 0, high nibble 9 (-0.5) at column 1; scale 2^1
    data = torch.full((1, 16), 0x92, dtype=torch.uint8)
    weight = QuantizedWeight(QuantType.MXFP4, (1, 32), data, torch.tensor([[128]], dtype=torch.uint8))
    assert dequantize(weight)[0, :2].tolist() == [2.0, -1.0]


def test_e8m0_bytes_match_torchs_float8_e8m0fnu() -> None:
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = e8m0_to_float(every_byte)
    torch_values = every_byte.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.equal(ours[:255], torch_values[:255])
    assert ours[127] == 1.0 and ours[0] == 2.0**-127
    assert ours[255].isnan() and torch_values[255].isnan()


def test_fp8_nan_codes_stay_nan() -> None:
    data = torch.zeros(128, 128, dtype=torch.uint8)
    data[5, 7], data[9, 1] = 0x7F, 0xFF
    weight = QuantizedWeight(
        QuantType.FP8_BLOCK, (128, 128), data, torch.full((1, 1), 127, dtype=torch.uint8)
    )
    assert dequantize(weight).isnan().nonzero().tolist() == [[5, 7], [9, 1]]


def stacked_weights() -> list[QuantizedWeight]:
    """One [5, out, in] expert stack per type, out/in chosen to be valid for each."""
    stacks = [random_gguf_weight(t, (5, 4, 512), seed=11) for t in GGUF_TYPES]
    stacks.append(random_fp8_weight((5, 130, 256), seed=12))
    stacks.append(random_mxfp4_weight((5, 6, 64), seed=13))
    for qtype, itemsize in ((QuantType.F16, 2), (QuantType.BF16, 2), (QuantType.F32, 4)):
        bits = torch.randint(
            0, 256, (5, 3, 8 * itemsize), dtype=torch.uint8, generator=torch.Generator().manual_seed(14)
        )
        bits.view(-1, itemsize)[:, -1] &= 0x3F  # clear each value's top exponent bit: finite values
        stacks.append(QuantizedWeight(qtype, (5, 3, 8), bits))
    return stacks


@pytest.mark.parametrize("weight", stacked_weights(), ids=lambda w: w.qtype.value)
def test_index_dequantizes_the_same_rows_as_the_full_tensor(weight: QuantizedWeight) -> None:
    full = dequantize(weight)
    assert torch.equal(dequantize(weight, index=[3, 0, 3]), full[[3, 0, 3]])
    assert torch.equal(dequantize(weight, index=torch.tensor([4, 1])), full[[4, 1]])
    assert torch.equal(dequantize(weight, index=2), full[2])
    assert dequantize(weight, index=[]).shape == (0, *weight.shape[1:])


def test_index_rows_of_a_2d_fp8_weight_use_their_block_scales() -> None:
    weight = random_fp8_weight((300, 256), seed=21)
    rows = [0, 127, 128, 299, 5]
    assert torch.equal(dequantize(weight, index=rows), dequantize(weight)[rows])


def test_dtype_is_one_rounding_of_the_float32_values() -> None:
    weight = random_gguf_weight(QuantType.Q4_K, (2, 256), seed=3)
    assert torch.equal(dequantize(weight, dtype=torch.bfloat16), dequantize(weight).to(torch.bfloat16))


def test_index_out_of_range_names_the_index() -> None:
    weight = random_gguf_weight(QuantType.Q8_0, (4, 2, 32), seed=0)
    with pytest.raises(IndexError, match="index 4 is out of range for a leading dim of 4"):
        dequantize(weight, index=[1, 4])
    with pytest.raises(IndexError, match="index -1 is out of range"):
        dequantize(weight, index=torch.tensor([-1]))


def test_data_of_the_wrong_size_is_rejected_with_both_sizes() -> None:
    with pytest.raises(
        ValueError, match=r"Q4_K weight of logical shape \(2, 512\): data has shape \(2, 287\)"
    ):
        QuantizedWeight(QuantType.Q4_K, (2, 512), torch.zeros(2, 287, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"expected \(2, 288\) \(576 bytes, 288 bytes per row\)"):
        QuantizedWeight(QuantType.Q4_K, (2, 512), torch.zeros(2, 287, dtype=torch.uint8))
    with pytest.raises(ValueError, match="buffer holds 100 bytes, expected 136"):
        QuantizedWeight.from_buffer(QuantType.Q8_0, (2, 64), torch.zeros(100, dtype=torch.uint8))


def test_input_dim_off_the_block_size_is_rejected() -> None:
    with pytest.raises(
        ValueError, match=r"IQ2_XXS weight: input dim 300 .* not a multiple of the 256-value block"
    ):
        QuantizedWeight(QuantType.IQ2_XXS, (4, 300), torch.zeros(4, 66, dtype=torch.uint8))
    with pytest.raises(ValueError, match="MXFP4 weight: input dim 48 .* 32-value block"):
        packed_shape(QuantType.MXFP4, (4, 48))


def test_scale_problems_are_named() -> None:
    data = torch.zeros(256, 256, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"FP8_BLOCK weight of logical shape \(256, 256\): scale is missing"):
        QuantizedWeight(QuantType.FP8_BLOCK, (256, 256), data)
    with pytest.raises(ValueError, match=r"scale has shape \(1, 2\), expected \(2, 2\)"):
        QuantizedWeight(QuantType.FP8_BLOCK, (256, 256), data, torch.zeros(1, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="Q8_0 weight: scale must be None"):
        QuantizedWeight(QuantType.Q8_0, (1, 32), torch.zeros(1, 34, dtype=torch.uint8), torch.zeros(1))
    with pytest.raises(TypeError, match="scale must be a 1-byte tensor"):
        QuantizedWeight(QuantType.MXFP4, (1, 32), torch.zeros(1, 16, dtype=torch.uint8), torch.ones(1, 1))
    with pytest.raises(TypeError, match="data must be a 1-byte tensor"):
        QuantizedWeight(QuantType.F16, (1, 4), torch.zeros(1, 4, dtype=torch.float16))


def test_nbytes_counts_packed_data_and_scales() -> None:
    weight = random_mxfp4_weight((4096, 2048), seed=1)
    assert weight.nbytes == 4096 * 1024 + 4096 * 64
    assert math.isclose(
        random_gguf_weight(QuantType.IQ2_XXS, (8, 4096), seed=1).nbytes * 8 / (8 * 4096), 2.0625
    )
