"""Random packed weights of every format over their whole value range (finite scales)."""

from __future__ import annotations

import numpy as np
import torch

from ds4_vllm.model.quant import QuantizedWeight, QuantType, block_layout, packed_shape, scale_shape

# Byte offsets of the fp16 d / dmin fields inside one block.
FP16_FIELDS = {
    QuantType.Q8_0: (0,),
    QuantType.Q2_K: (80, 82),
    QuantType.Q4_K: (0, 2),
    QuantType.IQ2_XXS: (0,),
}


def finite_gguf_blocks(raw: np.ndarray, qtype: QuantType) -> np.ndarray:
    """Random block bytes with every fp16 scale field made finite (exponent 31 -> 30), full range kept."""
    _, nbytes = block_layout(qtype)
    blocks = raw.reshape(-1, nbytes)
    for offset in FP16_FIELDS[qtype]:
        high = blocks[:, offset + 1]
        blocks[:, offset + 1] = np.where((high & 0x7C) == 0x7C, high ^ 0x04, high)
    return raw


def random_gguf_weight(qtype: QuantType, shape: tuple[int, ...], seed: int) -> QuantizedWeight:
    raw = np.random.default_rng(seed).integers(0, 256, size=packed_shape(qtype, shape), dtype=np.uint8)
    return QuantizedWeight(qtype, shape, torch.from_numpy(finite_gguf_blocks(raw, qtype)))


def random_fp8_weight(shape: tuple[int, ...], seed: int) -> QuantizedWeight:
    """E4M3 bytes without the two NaN codes, and scale bytes over the whole finite range 0..254."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    data[(data & 0x7F) == 0x7F] = 0x7E
    scale = torch.randint(0, 255, scale_shape(QuantType.FP8_BLOCK, shape), dtype=torch.uint8, generator=g)
    return QuantizedWeight(QuantType.FP8_BLOCK, shape, data, scale)


def random_mxfp4_weight(shape: tuple[int, ...], seed: int) -> QuantizedWeight:
    """int8 code pairs as the safetensors files store them; scale bytes 0..254."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(-128, 128, packed_shape(QuantType.MXFP4, shape), dtype=torch.int8, generator=g)
    scale = torch.randint(0, 255, scale_shape(QuantType.MXFP4, shape), dtype=torch.uint8, generator=g)
    return QuantizedWeight(QuantType.MXFP4, shape, data, scale)
