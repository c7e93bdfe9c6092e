"""The quantization round trips of DeepSeek V4's official graph ("QAT numerics"), in plain torch.

DeepSeek trained V4 with these round trips in the forward pass, and the official inference
code and the ds4 engine keep them (spec ``ds4-model-and-vllm.md`` §1.11):

- the 448 no-RoPE dims of every main KV row (raw window rows and compressed rows, after RoPE)
  go through FP8 E4M3 in blocks of 64 (`fp8_kv_roundtrip`);
- indexer queries and indexer compressed rows (after RoPE) are rotated by a 128-point
  Walsh-Hadamard transform and go through FP4 E2M1 in blocks of 32 (`indexer_qat`).

What is not here: ds4's CUDA and Metal backends also round each raw-window row to float16 when
they store it (its CPU reference path does not). That is those backends' storage format, not
DeepSeek's graph, whose cache holds the model dtype; our cache does the same. FP8-rounded
values with power-of-two scales are exact in bfloat16 and float32, so the cache dtype keeps
them as they are.

Every function quantizes and dequantizes in one go: the result has the input's dtype and
shape and holds exactly the values the low-precision format can represent. Work is done in
float32 with exact power-of-two scales, so results are the same on every device.

Scales are ``2 ** ceil(log2(amax / format_max))`` computed exactly from the float's bits, as
DeepSeek's kernels do (`fast_log2_ceil`). ds4 computes ``ceilf(log2f(...))``, which agrees
except when ``amax / format_max`` lies within a few float32 ulps above a power of two, where
``log2f`` may round down to the integer; that case is rare enough (about 1e-7 of blocks of
float32 data, never for bf16 data) to leave aside.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
FP8_KV_BLOCK = 64
FP8_AMAX_FLOOR = 1e-4  # ds4 and DeepSeek's act_quant: tiny blocks share one scale

FP4_E2M1_MAX = 6.0
FP4_BLOCK = 32
FP4_AMAX_FLOOR = 6.0 * 2.0**-126  # keeps amax / 6 a normal float32

HADAMARD_BLOCK = 128

_EXPONENT_BIAS = 127
_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2 ** exponent`` for int32 exponents in the normal range [-126, 127]."""
    return ((exponent + _EXPONENT_BIAS) << _MANTISSA_BITS).view(torch.float32)


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2(x))`` of positive float32 values from the exponent bits (-127 for 0 and subnormals)."""
    return ((x.view(torch.int32) >> _MANTISSA_BITS) & 0xFF) - _EXPONENT_BIAS


def pow2_ceil_scale(amax: torch.Tensor, format_max: float) -> torch.Tensor:
    """``2 ** ceil(log2(amax / format_max))`` for positive float32 ``amax``, exact (no log2 rounding)."""
    ratio = amax / format_max
    bits = ratio.view(torch.int32)
    exponent = _floor_log2(ratio) + ((bits & _MANTISSA_MASK) != 0).to(torch.int32)
    return _pow2(exponent)


def round_to_minifloat(x: torch.Tensor, mantissa_bits: int, min_exponent: int) -> torch.Tensor:
    """Round float32 ``x`` to the nearest value with ``mantissa_bits`` stored bits, ties to even.

    ``min_exponent`` is the format's smallest normal exponent; below it the grid is uniform
    (subnormals). The range is not limited here: callers clamp to the format's maximum first.
    Because the grid step is a power of two, ``|x| / step`` is exact and ``torch.round``'s
    half-to-even rule is the format's round-to-nearest-even on the code.
    """
    magnitude = x.abs()
    exponent = _floor_log2(magnitude).clamp(min=min_exponent)
    step = _pow2(exponent - mantissa_bits)
    return torch.copysign(torch.round(magnitude / step) * step, x)


def _blocks(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"{what}: last dim {x.shape[-1]} is not a multiple of the block size {block}")
    return x.float().unflatten(-1, (-1, block))


def fp8_e4m3_roundtrip_blocks(x: torch.Tensor, block: int = FP8_KV_BLOCK) -> torch.Tensor:
    """FP8 E4M3 quantize/dequantize over blocks of ``block`` along the last dim.

    Per block: scale = 2^ceil(log2(max(amax, 1e-4) / 448)); x / scale is clamped to ±448 and
    rounded to the nearest E4M3 value (ties to even); the result is that value times scale.
    """
    blocks = _blocks(x, block, "fp8_e4m3_roundtrip_blocks")
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=FP8_AMAX_FLOOR)
    scale = pow2_ceil_scale(amax, FP8_E4M3_MAX)
    scaled = (blocks / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    rounded = round_to_minifloat(scaled, mantissa_bits=3, min_exponent=-6)
    return (rounded * scale).flatten(-2).to(x.dtype)


def fp4_e2m1_roundtrip_blocks(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """FP4 E2M1 quantize/dequantize over blocks of ``block`` along the last dim.

    Per block: scale = 2^ceil(log2(max(amax, 6·2^-126) / 6)); x / scale is clamped to ±6 and
    rounded to the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6 (ties to the even code).
    """
    blocks = _blocks(x, block, "fp4_e2m1_roundtrip_blocks")
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_AMAX_FLOOR)
    scale = pow2_ceil_scale(amax, FP4_E2M1_MAX)
    scaled = (blocks / scale).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)
    rounded = round_to_minifloat(scaled, mantissa_bits=1, min_exponent=0)
    return (rounded * scale).flatten(-2).to(x.dtype)


def walsh_hadamard(x: torch.Tensor, block: int = HADAMARD_BLOCK) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform (Sylvester order) of each ``block`` of the last dim.

    Butterflies run in float32 in ds4's order (strides 1, 2, 4, ...), then one multiply by
    float32(1/sqrt(block)), so the result matches ds4's ``dsv4_hadamard128`` bit for bit.
    """
    if block < 1 or block & (block - 1):
        raise ValueError(f"walsh_hadamard: block size {block} is not a power of two")
    y = _blocks(x, block, "walsh_hadamard")
    prefix = y.shape[:-1]
    half = 1
    while half < block:
        pairs = y.reshape(*prefix, block // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*prefix, block)
        half *= 2
    scale = torch.tensor(block**-0.5, dtype=torch.float32, device=y.device)
    return (y * scale).flatten(-2).to(x.dtype)


def hadamard_128(x: torch.Tensor) -> torch.Tensor:
    """128-point orthonormal Walsh-Hadamard transform over the last dim (blocks of 128)."""
    return walsh_hadamard(x, HADAMARD_BLOCK)


def fp8_kv_roundtrip(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """A main KV row as the official graph caches it: FP8 round trip of the leading no-RoPE dims.

    The trailing ``rope_dim`` dims (already rotated) are kept as they are.
    """
    nope = x.shape[-1] - rope_dim
    if nope <= 0:
        return x
    return torch.cat([fp8_e4m3_roundtrip_blocks(x[..., :nope]), x[..., nope:]], dim=-1)


def indexer_hadamard_block(head_dim: int) -> int:
    """Hadamard block for indexer heads: 128 (DeepSeek V4); narrower power-of-two heads use their width."""
    return min(head_dim, HADAMARD_BLOCK)


def indexer_qat(x: torch.Tensor) -> torch.Tensor:
    """Indexer query or key rows (heads along the last dim) as the official graph scores them.

    Walsh-Hadamard rotation then FP4 round trip. The rotation is orthonormal, so without the FP4
    step q·k would not change; with it, keys must be stored in the rotated basis (as ds4 does).
    """
    return fp4_e2m1_roundtrip_blocks(walsh_hadamard(x, indexer_hadamard_block(x.shape[-1])))
