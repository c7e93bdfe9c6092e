"""Dequantization of packed weights to float, in vectorized torch (any device, no per-block Python).

Every kernel reproduces the reference arithmetic operation for operation (gguf-py's numpy
dequantizers for the GGUF types, transformers' ``Fp8Dequantize`` for FP8_BLOCK and MXFP4), so
results are bit-identical in float32; the tests check that with ``torch.equal``.

The IQ2_XXS grid and sign tables are read from the installed ``gguf`` package at import time
(``gguf.quants.IQ2_XXS``), not copied here: gguf-py is already a dependency and is the
reference we test against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf.quants import IQ2_XXS as _GGUF_IQ2_XXS

from ds4_vllm.model.quant import (
    FP8_BLOCK_SIZE,
    MXFP4_GROUP_SIZE,
    QuantizedWeight,
    QuantType,
)

IndexLike = int | Sequence[int] | torch.Tensor


def _iq2xxs_signed_grid() -> torch.Tensor:
    """[256 * 128, 8] float32: grid row g (magnitudes 8/25/43) with sign pattern p at row g * 128 + p.

    Both tables come from gguf-py's IQ2_XXS (``grid`` after ``init_grid()``, ``ksigns``).
    """
    _GGUF_IQ2_XXS.init_grid()
    grid = torch.from_numpy(np.asarray(_GGUF_IQ2_XXS.grid, dtype=np.float32).reshape(256, 8).copy())
    ksigns = torch.from_numpy(np.frombuffer(_GGUF_IQ2_XXS.ksigns, dtype=np.uint8).copy()).to(torch.int32)
    negative = (ksigns[:, None] >> torch.arange(8, dtype=torch.int32)) & 1
    signs = torch.where(negative == 1, -1.0, 1.0).to(torch.float32)
    return (grid[:, None, :] * signs[None, :, :]).reshape(256 * 128, 8)


def _fp4_pairs() -> torch.Tensor:
    """[256] int64 whose bytes are the two float32 values (low nibble first) of an MXFP4 byte.

    E2M1 code bit 3 is the sign (transformers' table order); one 8-byte gather per packed
    byte is several times faster than two float gathers.
    """
    values = torch.tensor(
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
        dtype=torch.float32,
    )
    byte = torch.arange(256)
    return (
        torch.stack((values[byte & 0xF], values[byte >> 4]), dim=-1).contiguous().view(torch.int64).view(256)
    )


def _fp8_pairs() -> torch.Tensor:
    """[65536] int64 whose bytes are the float32 values of the two E4M3 bytes of a little-endian uint16."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    pair = torch.arange(65536)
    return (
        torch.stack((values[pair & 0xFF], values[pair >> 8]), dim=-1).contiguous().view(torch.int64).view(-1)
    )


_TABLE_BUILDERS = {"iq2_signed_grid": _iq2xxs_signed_grid, "fp4_pairs": _fp4_pairs, "fp8_pairs": _fp8_pairs}
_table_cache: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    """A constant lookup table on ``device``, built (on CPU) and copied there once."""
    key = (name, device)
    if key not in _table_cache:
        cpu_key = (name, torch.device("cpu"))
        if cpu_key not in _table_cache:
            _table_cache[cpu_key] = _TABLE_BUILDERS[name]()
        _table_cache[key] = _table_cache[cpu_key].to(device)
    return _table_cache[key]


_table("iq2_signed_grid", torch.device("cpu"))  # read gguf-py's tables at import time


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32 2^(byte-127), built from the bits: byte 0 is 2^-127, 255 is NaN."""
    exponent = scale.to(torch.int32)
    bits = torch.where(exponent == 0, 0x00400000, exponent << 23)
    bits = torch.where(exponent == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _blocks(data: torch.Tensor, bytes_per_block: int) -> torch.Tensor:
    return data.reshape(-1, bytes_per_block)


def _dequant_q8_0(data: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(data, 34)
    d = _f16(blocks, 0)
    return blocks[:, 2:].view(torch.int8).to(torch.float32).mul_(d)


def _dequant_q2_k(data: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(data, 84)
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0xF).to(torch.float32)).view(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).view(n, 16, 1)
    halves = qs.reshape(n, 2, 32)
    q = torch.stack((halves & 3, (halves >> 2) & 3, (halves >> 4) & 3, halves >> 6), dim=2)
    return q.view(n, 16, 16).to(torch.float32).mul_(dl).sub_(ml).view(n, 256)


def _dequant_q4_k(data: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(data, 144)
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    lo, mid, hi = packed[:, 0], packed[:, 1], packed[:, 2]
    # 6-bit scales/mins of the 8 sub-blocks: first four in the low 6 bits of bytes 0-3 / 4-7,
    # last four from the nibbles of bytes 8-11 plus the top two bits of bytes 0-3 / 4-7.
    sc = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)), dim=-1)
    mn = torch.cat((mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)), dim=-1)
    dl = (d * sc.to(torch.float32)).view(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).view(n, 8, 1)
    chunks = blocks[:, 16:].reshape(n, 4, 32)
    q = torch.stack((chunks & 0xF, chunks >> 4), dim=2)  # low nibbles: sub-block 2j, high: 2j+1
    return q.view(n, 8, 32).to(torch.float32).mul_(dl).sub_(ml).view(n, 256)


def _dequant_iq2_xxs(data: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(data, 66)
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    # 8 groups of 32 values, each 8 bytes: 4 grid indices, then a little-endian uint32 holding
    # four 7-bit sign-pattern indices (bits 0-27) and the 4-bit group scale (bits 28-31).
    groups = blocks[:, 2:].reshape(n, 8, 8)
    grid_index = groups[:, :, :4].to(torch.int64)
    aux = groups[:, :, 4:].to(torch.int64)
    aux32 = aux[..., 0] | (aux[..., 1] << 8) | (aux[..., 2] << 16) | (aux[..., 3] << 24)
    db = (d * (0.5 + (aux32 >> 28).to(torch.float32)) * 0.25).view(n, 8, 1, 1)
    sign_shift = torch.tensor([0, 7, 14, 21], dtype=torch.int64, device=data.device)
    sign_index = (aux32.unsqueeze(-1) >> sign_shift) & 0x7F
    # One gather from the signed grid (grid row x sign pattern): +-g is exact, so db * (+-g)
    # equals gguf-py's (db * g) * (+-1) bit for bit.
    signed_rows = _table("iq2_signed_grid", data.device).index_select(
        0, (grid_index * 128 + sign_index).view(-1)
    )
    return signed_rows.view(n, 8, 4, 8).mul_(db).view(n, 256)


_GGUF_KERNELS: dict[QuantType, Callable[[torch.Tensor], torch.Tensor]] = {
    QuantType.Q8_0: _dequant_q8_0,
    QuantType.Q2_K: _dequant_q2_k,
    QuantType.Q4_K: _dequant_q4_k,
    QuantType.IQ2_XXS: _dequant_iq2_xxs,
}
_PLAIN_DTYPES = {QuantType.F32: torch.float32, QuantType.F16: torch.float16, QuantType.BF16: torch.bfloat16}


def _e4m3_to_float(data: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes -> float32 (NaN codes stay NaN), two bytes per table gather when rows are even."""
    if data.shape[-1] % 2 or data.numel() == 0:
        return data.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    pairs = data.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    values = _table("fp8_pairs", data.device).index_select(0, pairs.view(-1))
    return values.view(torch.float32).view(data.shape)


def _fp8_block(data: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes [..., rows, in] times the per-row block scales [..., rows, ceil(in/128)]."""
    cols = data.shape[-1]
    n_col_blocks = row_scale.shape[-1]
    pad = n_col_blocks * FP8_BLOCK_SIZE - cols
    q = _e4m3_to_float(data)
    if pad:
        q = F.pad(q, (0, pad))
    q = q.view(*q.shape[:-1], n_col_blocks, FP8_BLOCK_SIZE).mul_(e8m0_to_float(row_scale).unsqueeze(-1))
    q = q.view(*q.shape[:-2], n_col_blocks * FP8_BLOCK_SIZE)
    return q[..., :cols].contiguous() if pad else q


def _mxfp4(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 code pairs [..., in/2] (low nibble = even column) times E8M0 scales [..., in/32]."""
    pairs = _table("fp4_pairs", data.device).index_select(0, data.reshape(-1).to(torch.int32))
    values = pairs.view(torch.float32).view(*scale.shape, MXFP4_GROUP_SIZE)  # int64 = two float32
    return values.mul_(e8m0_to_float(scale).unsqueeze(-1)).view(*data.shape[:-1], 2 * data.shape[-1])


def _resolve_index(index: IndexLike, length: int, device: torch.device, check: bool = True) -> torch.Tensor:
    """Leading-dim selection as a 1-D int64 tensor on ``device``, with its range checked (``check``)."""
    if isinstance(index, torch.Tensor):
        if index.dtype.is_floating_point or index.dtype == torch.bool or index.dim() > 1:
            raise TypeError(
                f"index must be an int or a 1-D integer tensor, got {index.dtype} of shape {index.shape}"
            )
        ids = index.reshape(-1).to(device=device, dtype=torch.int64)
    else:
        ids = torch.tensor(list(index), dtype=torch.int64, device=device)
    if check and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= length:
            bad = lo if lo < 0 else hi
            raise IndexError(f"index {bad} is out of range for a leading dim of {length}")
    return ids


def dequantize(
    weight: QuantizedWeight,
    index: IndexLike | None = None,
    dtype: torch.dtype = torch.float32,
    check_index: bool = True,
) -> torch.Tensor:
    """Dequantize ``weight`` (or only the leading-dim rows ``index`` selects) to ``dtype``.

    ``index`` picks entries of the first dim (experts of an [E, out, in] stack, rows of a 2-D
    weight): an int drops that dim like tensor indexing, a sequence or 1-D tensor keeps it.
    Only the selected rows' bytes are read. The values are computed in float32 and converted
    once at the end. For F32/F16/BF16 weights already in ``dtype`` the result is a view of
    ``weight.data`` (do not write to it). ``check_index=False`` skips the range check of a
    tensor ``index`` that the caller has clamped (the check reads it back from the device).
    """
    qtype, shape = weight.qtype, weight.shape
    data, scale = weight.data, weight.scale
    squeeze = isinstance(index, int) and not isinstance(index, bool)
    ids = None
    if index is not None:
        ids = _resolve_index([index] if squeeze else index, shape[0], data.device, check_index)
        shape = (ids.numel(), *shape[1:])
        data = data.index_select(0, ids)
        if scale is not None and not (qtype is QuantType.FP8_BLOCK and len(weight.shape) == 2):
            scale = scale.index_select(0, ids)

    if qtype in _PLAIN_DTYPES:
        values = data.contiguous().view(_PLAIN_DTYPES[qtype]).view(shape)
    elif qtype.is_gguf_block:
        values = _GGUF_KERNELS[qtype](data).view(shape)
    elif qtype is QuantType.FP8_BLOCK:
        assert scale is not None
        if ids is not None and len(weight.shape) == 2:
            row_scale = scale.index_select(0, torch.div(ids, FP8_BLOCK_SIZE, rounding_mode="floor"))
        else:
            row_scale = scale.repeat_interleave(FP8_BLOCK_SIZE, dim=-2)[..., : shape[-2], :]
        values = _fp8_block(data, row_scale)
    elif qtype is QuantType.MXFP4:
        assert scale is not None
        values = _mxfp4(data, scale)
    else:  # pragma: no cover - every QuantType is handled above
        raise NotImplementedError(f"no dequantization for {qtype}")
    if values.dtype != dtype:
        values = values.to(dtype)
    return values[0] if squeeze else values


__all__ = ["dequantize", "e8m0_to_float", "IndexLike"]
