"""Quantized weights kept packed in memory: the block formats real DeepSeek V4 files use.

`QuantizedWeight` is the one representation every loader (safetensors FP8/MXFP4, ds4 GGUF)
hands to the model: the file's raw bytes (memory-mapped where the format allows) plus the type
and logical shape. Modules dequantize on use, and routed experts only for the experts a batch
selected, so resident memory stays close to the file's size.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class QuantType(enum.Enum):
    """Block formats, named as the files name them."""

    F32 = "F32"
    F16 = "F16"
    BF16 = "BF16"
    Q8_0 = "Q8_0"  # GGUF: 32 values in 34 bytes
    Q2_K = "Q2_K"  # GGUF: 256 values in 84 bytes
    Q4_K = "Q4_K"  # GGUF: 256 values in 144 bytes
    IQ2_XXS = "IQ2_XXS"  # GGUF: 256 values in 66 bytes
    FP8_BLOCK = "FP8_BLOCK"  # safetensors: E4M3 bytes + UE8M0 scale per 128x128 block
    MXFP4 = "MXFP4"  # safetensors: two E2M1 codes per byte + UE8M0 scale per 32 inputs


@dataclass
class QuantizedWeight:
    """A weight of logical shape ``shape`` (torch order, [..., out, in]) stored packed.

    ``data`` holds the packed bytes as a ``uint8`` tensor whose leading dims are the weight's
    leading dims (e.g. [experts, out, packed_bytes_per_row]); ``scale`` is the separate scale
    tensor of the safetensors formats (``uint8`` E8M0 bytes), None for GGUF types whose scales
    live inside the blocks.
    """

    qtype: QuantType
    shape: tuple[int, ...]
    data: torch.Tensor
    scale: torch.Tensor | None = None
