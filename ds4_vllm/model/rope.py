"""Interleaved (GPT-J style) rotary embedding on the trailing slice of a head.

DeepSeek V4 rotates only the last ``rope_dim`` channels of each head, pairing
channels (2k, 2k+1). Sliding-only layers use the "main" parameters (plain RoPE,
theta 10000); compressed layers, their compressors and the indexer use the
"compress" parameters (theta 160000 with YaRN). The frequencies follow
transformers' ``default`` and ``yarn`` initialisers so logits agree with it.
"""

from __future__ import annotations

import math

import torch


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(params: dict, rope_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (one per channel pair) and the cos/sin scale for one rope type."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return 1.0 / (base**exponents), 1.0
    if rope_type != "yarn":
        raise ValueError(
            f"rope_parameters.rope_type={rope_type!r} is not supported (use 'default' or 'yarn')"
        )

    factor = float(params["factor"])
    original_len = int(params["original_max_position_embeddings"])
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base**exponents
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


class TailRope(torch.nn.Module):
    """Rotates the trailing ``rope_dim`` channels; ``inverse=True`` undoes it (used on attention outputs)."""

    def __init__(self, params: dict, rope_dim: int) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(params, rope_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = scale
        self.rope_dim = rope_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos() * self.scale, freqs.sin() * self.scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x: [T, ..., D] with positions [T]. ``inverse`` rotates x in place (the attention output,
        which nothing else reads: a prefill chunk's is 256 MiB at real widths) and returns it."""
        cos, sin = self.cos_sin(positions)
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.rope_dim // 2,)
        cos, sin = cos.view(shape), sin.view(shape)
        rope = x[..., -self.rope_dim :].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        if inverse:
            x[..., -self.rope_dim :] = rotated.to(x.dtype)
            return x
        return torch.cat([x[..., : -self.rope_dim], rotated.to(x.dtype)], dim=-1)
