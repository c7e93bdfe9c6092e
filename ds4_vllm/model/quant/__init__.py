"""Quantized weights kept packed in memory: the block formats real DeepSeek V4 files use.

`QuantizedWeight` is the one representation every loader (safetensors FP8/MXFP4, ds4 GGUF)
hands to the model: the file's raw bytes (memory-mapped where the format allows) plus the type
and logical shape. Modules dequantize on use, and routed experts only for the experts a batch
selected, so resident memory stays close to the file's size.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


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

    @property
    def is_gguf_block(self) -> bool:
        """True for the GGUF block types whose scales live inside the blocks."""
        return self in _GGUF_BLOCK_TYPES

    @property
    def has_scale_tensor(self) -> bool:
        """True for the safetensors types that carry a separate E8M0 scale tensor."""
        return self in (QuantType.FP8_BLOCK, QuantType.MXFP4)


_GGUF_BLOCK_TYPES = frozenset({QuantType.Q8_0, QuantType.Q2_K, QuantType.Q4_K, QuantType.IQ2_XXS})
_PLAIN_ITEMSIZE = {QuantType.F32: 4, QuantType.F16: 2, QuantType.BF16: 2}

#: Rows and columns covered by one FP8_BLOCK scale byte.
FP8_BLOCK_SIZE = 128
#: Input columns covered by one MXFP4 scale byte.
MXFP4_GROUP_SIZE = 32


def block_layout(qtype: QuantType) -> tuple[int, int]:
    """(values per block, bytes per block) along the input dim; the GGUF sizes come from gguf-py."""
    if qtype.is_gguf_block:
        return GGML_QUANT_SIZES[GGMLQuantizationType[qtype.value]]
    if qtype in _PLAIN_ITEMSIZE:
        return 1, _PLAIN_ITEMSIZE[qtype]
    if qtype is QuantType.FP8_BLOCK:
        return 1, 1
    return 2, 1  # MXFP4: two codes per byte


def _check_logical_shape(qtype: QuantType, shape: tuple[int, ...]) -> None:
    if not shape or any(d < 0 for d in shape):
        raise ValueError(
            f"{qtype.value} weight: logical shape {shape} must have at least one dim, none negative"
        )
    if qtype is QuantType.FP8_BLOCK and len(shape) < 2:
        raise ValueError(f"FP8_BLOCK weight: logical shape {shape} needs [..., out, in] (2 dims or more)")
    per_block, _ = block_layout(qtype)
    group = MXFP4_GROUP_SIZE if qtype is QuantType.MXFP4 else per_block
    if shape[-1] % group:
        raise ValueError(
            f"{qtype.value} weight: input dim {shape[-1]} (last dim of logical shape {shape}) is not a "
            f"multiple of the {group}-value block"
        )


def packed_shape(qtype: QuantType, shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of the ``uint8`` data tensor holding a weight of logical shape ``shape``."""
    shape = tuple(int(d) for d in shape)
    _check_logical_shape(qtype, shape)
    per_block, nbytes = block_layout(qtype)
    return (*shape[:-1], shape[-1] // per_block * nbytes)


def scale_shape(qtype: QuantType, shape: Sequence[int]) -> tuple[int, ...] | None:
    """Shape of the separate E8M0 scale tensor, or None for types without one."""
    shape = tuple(int(d) for d in shape)
    _check_logical_shape(qtype, shape)
    if qtype is QuantType.FP8_BLOCK:
        return (*shape[:-2], math.ceil(shape[-2] / FP8_BLOCK_SIZE), math.ceil(shape[-1] / FP8_BLOCK_SIZE))
    if qtype is QuantType.MXFP4:
        return (*shape[:-1], shape[-1] // MXFP4_GROUP_SIZE)
    return None


def _as_bytes(tensor: torch.Tensor, what: str, qtype: QuantType) -> torch.Tensor:
    """Reinterpret (never convert) a byte-sized tensor as uint8: int8 FP4 codes, E8M0/E4M3 bytes."""
    if tensor.dtype == torch.uint8:
        return tensor
    if tensor.element_size() == 1 and not tensor.dtype.is_complex:
        return tensor.view(torch.uint8)
    raise TypeError(f"{qtype.value} weight: {what} must be a 1-byte tensor (uint8 bytes), got {tensor.dtype}")


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
    #: ``data`` is a view of a memory-mapped file (GGUF): its pages are the page cache's, shared
    #: by every process mapping the file, and read only when used; a part of it stays a view.
    mapped: bool = False

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)
        self.data = _as_bytes(self.data, "data", self.qtype)
        want = packed_shape(self.qtype, self.shape)
        if tuple(self.data.shape) != want:
            raise ValueError(
                f"{self.qtype.value} weight of logical shape {self.shape}: data has shape "
                f"{tuple(self.data.shape)} ({self.data.numel()} bytes), expected {want} "
                f"({math.prod(want)} bytes, {want[-1]} bytes per row)"
            )
        want_scale = scale_shape(self.qtype, self.shape)
        if want_scale is None:
            if self.scale is not None:
                raise ValueError(
                    f"{self.qtype.value} weight: scale must be None (its scales are in the blocks)"
                )
            return
        if self.scale is None:
            raise ValueError(f"{self.qtype.value} weight of logical shape {self.shape}: scale is missing")
        self.scale = _as_bytes(self.scale, "scale", self.qtype)
        if tuple(self.scale.shape) != want_scale:
            raise ValueError(
                f"{self.qtype.value} weight of logical shape {self.shape}: scale has shape "
                f"{tuple(self.scale.shape)}, expected {want_scale}"
            )
        if self.scale.device != self.data.device:
            raise ValueError(
                f"{self.qtype.value} weight: data is on {self.data.device}, scale on {self.scale.device}"
            )

    @classmethod
    def from_buffer(
        cls, qtype: QuantType, shape: Sequence[int], data: torch.Tensor, scale: torch.Tensor | None = None
    ) -> QuantizedWeight:
        """Wrap a flat (or any-shaped) byte tensor, e.g. a GGUF tensor's bytes, reshaping it to the packed shape."""
        data = _as_bytes(data, "data", qtype)
        want = packed_shape(qtype, shape)
        if data.numel() != math.prod(want):
            raise ValueError(
                f"{qtype.value} weight of logical shape {tuple(shape)}: buffer holds {data.numel()} bytes, "
                f"expected {math.prod(want)}"
            )
        if scale is not None:
            scale = _as_bytes(scale, "scale", qtype)
            want_scale = scale_shape(qtype, shape)
            if want_scale is not None and scale.numel() == math.prod(want_scale):
                scale = scale.reshape(want_scale)
        return cls(qtype, tuple(shape), data.reshape(want), scale)

    def entry(self, i: int) -> QuantizedWeight:
        """Entry ``i`` of a stacked weight ([E, out, in] -> [out, in]) as a view of the same bytes."""
        if len(self.shape) < 3:
            raise ValueError(f"{self.qtype.value} weight of logical shape {self.shape} is not a stack")
        scale = None if self.scale is None else self.scale[i]
        return QuantizedWeight(self.qtype, self.shape[1:], self.data[i], scale, self.mapped)

    @property
    def nbytes(self) -> int:
        """Resident bytes: packed data plus scales."""
        scale_bytes = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.data.numel() * self.data.element_size() + scale_bytes

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same packed weight on another device (bytes copied as they are)."""
        scale = None if self.scale is None else self.scale.to(device)
        return QuantizedWeight(self.qtype, self.shape, self.data.to(device), scale)
