"""Packed GGUF weights applied to a few rows of activations without a float copy of the weight.

Each kernel is a tensor expression of one format (Q8_0, Q2_K, IQ2_XXS and the 16-bit floats F16,
BF16: what the ds4 q2 recipe stores) that reads the packed bytes, decodes them and reduces
against the activations.
Inductor fuses such an expression into one loop over the weight's bytes, which is what makes it
fast; run eagerly it would materialize a [rows, out, in] product, so only compiled kernels are
handed out (`linear_kernel`, `pairs_kernel`; None where torch.compile is disabled or the format
has no kernel here). Per block the arithmetic is the format's (as `dequant.py`, which stays the
reference), grouped as the format's scales are: the products of a block's integer codes are
summed before its scale is applied, so results differ from "dequantize, then matmul" by float32
summation order only.

Measured on the 2-core AVX-512 machine, one row through a [2048, 4096] weight (8M values):
Q8_0 0.7 ms, Q2_K 1.4-2.5 ms, IQ2_XXS 3.2-6.6 ms (its grid lookups vectorize poorly), against
11-22 ms to dequantize it eagerly and 1.7 ms for float32 weights in ``F.linear`` (0.6 ms bf16);
F16 [8192, 1024] 0.38 ms against 15 ms converted on use. The weight is read once per row, so the cost
grows with the rows (`MAX_ROWS`). Where Inductor's code is slow, a C++ loop
(``packed_cpu.cpp``, `native_extension`) runs instead: IQ2_XXS 1.75 ms, Q8_0 0.23 ms for a
[4096, 1024] weight (Inductor 0.49 ms); the Inductor expression stays the fallback.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
from gguf.quants import IQ2_XXS as _GGUF_IQ2_XXS

from ds4_vllm.model.quant import QuantType
from ds4_vllm.model.quant.dequant import _table

logger = logging.getLogger(__name__)

#: Rows of activations up to which a fused kernel beats dequantizing the weight and multiplying
#: (`quant_linear`): the kernel reads the weight once per row. Measured for the 129,280 x 256
#: Q8_0 head: 4.7 / 18.7 / 29.7 ms fused for 1 / 4 / 8 rows against 44.6 / 32.8 / 30.5 ms; for
#: a [4096, 1024] weight 0.40 / 1.47 / 3.44 against 1.94 / 3.32 / 3.34 ms.
MAX_ROWS = 4
#: The same for the C++ loops (`native_extension`), which take a weight row from memory once for
#: all rows: the 129,280 x 256 Q8_0 head, 2.1 / 8.0 ms for 1 / 4 rows against 28-30 ms
#: dequantized in row blocks for 1-8 rows; [4096, 1024], 0.23 / 0.83 ms against 1.9-3.3 ms.
NATIVE_MAX_ROWS = 8
#: (token, expert) pairs up to which routed experts may run pair by pair through the kernel (each
#: pair reads its expert's bytes) rather than dequantizing each used expert once: a decode batch
#: of 8 at top-6 (`QuantExperts._fused_fits` also asks for few pairs per used expert).
MAX_PAIRS = 48

LinearKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PairsKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _fp16_field(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """A little-endian fp16 field from its two bytes, as float32 (a bit cast Inductor can fuse)."""
    bits = (lo.to(torch.int32) | (hi.to(torch.int32) << 8)).to(torch.int16)
    return bits.view(torch.float16).to(torch.float32)


def _q8_0(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [P, K] float32, rows [P or 1, N, K / 32 * 34] -> [P, N]: sum_b d_b * (x_b . q_b)."""
    x = x.view(x.shape[0], 1, -1, 32)  # block sizes are literals: Dynamo keeps them static
    blocks = rows.view(rows.shape[0], rows.shape[1], -1, 34)
    q = blocks[..., 2:].view(torch.int8).to(torch.float32)
    d = _fp16_field(blocks[..., 0], blocks[..., 1])
    return ((x * q).sum(-1) * d).sum(-1)


def _q2_k(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [P, K] float32, rows [P or 1, N, K / 256 * 84] -> [P, N].

    A block's value v (= 128 h + 32 s + i) is code ``(qs[32 h + i] >> 2 s) & 3`` of sub-block
    v // 16 (scale ``d * (sc & 15)``, min ``dmin * (sc >> 4)``); the four shifts are summed apart
    so each reduction runs over contiguous code bytes.
    """
    blocks = rows.view(rows.shape[0], rows.shape[1], -1, 84)
    lead = blocks.shape[:-1]
    sc = blocks[..., :16].reshape(*lead, 2, 4, 2)  # sub-block (h, s, i // 16)
    qs = blocks[..., 16:80].reshape(*lead, 2, 2, 16)  # (h, i // 16, i % 16)
    xv = x.view(x.shape[0], 1, -1, 2, 4, 2, 16)
    scaled = 0
    for s in range(4):
        codes = ((qs >> (2 * s)) & 3).to(torch.float32)
        part = (xv[..., s, :, :] * codes).sum(-1)  # [P, N, nb, 2, 2]
        scaled = scaled + (part * (sc[..., s, :] & 0xF).to(torch.float32)).sum((-1, -2))
    mins = (xv.sum(-1) * (sc >> 4).to(torch.float32)).sum((-1, -2, -3))
    d, dmin = _fp16_field(blocks[..., 80], blocks[..., 81]), _fp16_field(blocks[..., 82], blocks[..., 83])
    return (scaled * d - mins * dmin).sum(-1)


#: `dequant`'s signed grid (gguf-py's tables: grid row g with sign pattern p at row g * 128 + p)
#: as int8, 256 KiB: its values are +-8, 25, 43.
_IQ2_GRID = _table("iq2_signed_grid", torch.device("cpu")).to(torch.int8)
_IQ2_SIGN_SHIFTS = torch.tensor([0, 7, 14, 21], dtype=torch.int64)


def _iq2_xxs(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [P, K] float32, rows [P or 1, N, K / 256 * 66] -> [P, N].

    Per group of 32 values: four grid rows (bytes 0-3 of the group) with four 7-bit sign
    patterns and the 4-bit group scale in the little-endian uint32 of bytes 4-7.
    """
    blocks = rows.view(rows.shape[0], rows.shape[1], -1, 66)
    lead = blocks.shape[:-1]
    groups = blocks[..., 2:].reshape(*lead, 8, 8)
    grid_index = groups[..., :4].to(torch.int64)
    aux = groups[..., 4:].to(torch.int64)
    aux32 = aux[..., 0] | (aux[..., 1] << 8) | (aux[..., 2] << 16) | (aux[..., 3] << 24)
    signs = (aux32.unsqueeze(-1) >> _IQ2_SIGN_SHIFTS) & 0x7F
    signed = _IQ2_GRID[grid_index * 128 + signs].to(torch.float32)  # [..., 8, 4, 8]
    part = (x.view(x.shape[0], 1, -1, 8, 4, 8) * signed).sum(-1).sum(-1)  # [P, N, nb, 8]
    d = _fp16_field(blocks[..., 0], blocks[..., 1]).unsqueeze(-1)
    group_scale = d * (0.5 + (aux32 >> 28).to(torch.float32)) * 0.25
    return (part * group_scale).sum((-1, -2))


def _plain(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A 16-bit float format stored as bytes (the ds4 GGUFs' F16 compressors and indexer)."""

    def plain(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x [P, K] float32, rows [P or 1, N, 2 K] bytes -> [P, N]."""
        return (x.unsqueeze(1) * rows.view(dtype).to(torch.float32)).sum(-1)

    return plain


#: Format -> kernel.
_FORMATS: dict[QuantType, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    QuantType.Q8_0: _q8_0,
    QuantType.Q2_K: _q2_k,
    QuantType.IQ2_XXS: _iq2_xxs,
    QuantType.F16: _plain(torch.float16),
    QuantType.BF16: _plain(torch.bfloat16),
}
FUSED_TYPES = frozenset(_FORMATS)


def _linear(qtype: QuantType) -> LinearKernel:
    kernel = _FORMATS[qtype]

    def linear(x: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 through packed rows ``data`` [N, row bytes] -> [M, N]."""
        return kernel(x, data.unsqueeze(0))

    return linear


def _pairs(qtype: QuantType) -> PairsKernel:
    kernel = _FORMATS[qtype]

    def pairs(x: torch.Tensor, data: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Row p of x [P, K] float32 through matrix ``ids[p]`` of the stack ``data`` [E, N, row
        bytes] -> [P, N] (the gather is fused: only the picked matrices' bytes are read)."""
        return kernel(x, data[ids])

    return pairs


_compiled: dict[tuple[str, QuantType], Callable] = {}

#: Graphs a kernel may keep: Dynamo specializes on one row and on input sizes that happen to be
#: equal (a 256 x 256 weight), so a model's shapes need a few per kernel; Dynamo's default limit
#: is 8 per function, shared by the formats' closures. Raised once, globally, as vLLM's own
#: flex-attention backend does.
RECOMPILE_LIMIT = 64


def compile_enabled() -> bool:
    """False where torch.compile is turned off (``TORCH_COMPILE_DISABLE``): no fused kernels then."""
    return not torch._dynamo.config.disable


def _compiled_kernel(kind: str, qtype: QuantType) -> Callable | None:
    if qtype not in _FORMATS or not compile_enabled():
        return None
    key = (kind, qtype)
    if key not in _compiled:
        if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
            torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
        make = _linear if kind == "linear" else _pairs
        # dynamic: a graph serves every weight shape and row count of a format, up to Dynamo's
        # specializations (see RECOMPILE_LIMIT).
        _compiled[key] = torch.compile(make(qtype), dynamic=True, fullgraph=True)
    return _compiled[key]


def linear_kernel(qtype: QuantType) -> LinearKernel | None:
    """The compiled ``(x [M, K] float32, data [N, row bytes]) -> [M, N]`` kernel of a format, or None."""
    return _compiled_kernel("linear", qtype)


def pairs_kernel(qtype: QuantType) -> PairsKernel | None:
    """The compiled ``(x [P, K] float32, data [E, N, row bytes], ids [P]) -> [P, N]`` kernel, or None."""
    return _compiled_kernel("pairs", qtype)


@dataclass(frozen=True)
class FusedKernels:
    """The compiled kernels of one block format, as the model's layers call them."""

    qtype: QuantType
    linear: LinearKernel
    pairs: PairsKernel
    #: Rows up to which a dense or grouped projection takes the kernel.
    max_rows: int = MAX_ROWS
    #: (token, expert) pairs up to which routed experts take the kernel.
    max_pairs: int = MAX_PAIRS

    def project(self, x: torch.Tensor, data: torch.Tensor, groups: int = 0) -> torch.Tensor:
        """``x @ W.T`` for packed rows ``data`` [out, row bytes] (``groups`` 0), or the grouped
        projection: x [t, g, in / g], group j through rows j of the g equal row blocks."""
        rows = x.reshape(-1, x.shape[-1]).float()
        if groups:
            ids = torch.arange(groups, device=x.device).repeat(x.shape[0])
            out = self.pairs(rows, data.view(groups, -1, data.shape[-1]), ids)
        else:
            out = self.linear(rows, data)
        return out.view(*x.shape[:-1], -1).to(x.dtype)

    def matrices(self, x: torch.Tensor, data: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Row p of x [P, in] through matrix ``ids[p]`` of the packed stack ``data`` [E, out, row bytes]."""
        return self.pairs(x.float(), data, ids).to(x.dtype)


def kernels_for(qtype: QuantType) -> FusedKernels | None:
    """The fused kernels of a format; None without a kernel or with torch.compile off."""
    linear, pairs = linear_kernel(qtype), pairs_kernel(qtype)
    if linear is None or pairs is None:
        return None
    native = _native_pairs(qtype)
    if native is not None:
        return FusedKernels(qtype, _one_matrix(native), native, max_rows=NATIVE_MAX_ROWS)
    return FusedKernels(qtype, linear, pairs)


#: Formats with a C++ loop in ``packed_cpu.cpp`` (its function names), where Inductor's code for
#: the expression is slow: IQ2_XXS (grid lookups; 1.75 against 7 ms per [2048, 4096] matrix) and
#: Q8_0 (the LM head).
_NATIVE = {QuantType.IQ2_XXS: "iq2_xxs_pairs", QuantType.Q8_0: "q8_0_pairs"}


@cache
def native_extension():
    """``packed_cpu.cpp`` built once per machine by torch's extension loader (cached under
    ``~/.cache/torch_extensions``, about 25 s), or None (logged) where it cannot be built: no
    compiler or ninja, or a CPU without AVX2 and FMA."""
    try:
        return build_native_extension("ds4_vllm_packed_cpu", ["-O3", "-march=native"])
    except Exception as exc:  # the Inductor expressions still work
        logger.warning("the packed-weight CPU kernels could not be built (%s); using Inductor's", exc)
        return None


def build_native_extension(name: str, flags: list[str]):
    """``packed_cpu.cpp`` as module ``name``, compiled with ``flags`` (tests build other variants)."""
    from torch.utils.cpp_extension import load

    # torch's loader runs ninja, installed beside this interpreter in a virtual environment
    # whose bin directory is not always on PATH (``.venv/bin/vllm serve`` without activating).
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return load(name, [str(Path(__file__).with_name("packed_cpu.cpp"))], extra_cflags=flags)


def _iq2_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """gguf-py's IQ2_XXS grid [256, 8] (magnitudes) and ksigns [128], as uint8 tensors."""
    _GGUF_IQ2_XXS.init_grid()
    grid = np.asarray(_GGUF_IQ2_XXS.grid, dtype=np.uint8).reshape(256, 8).copy()
    ksigns = np.frombuffer(_GGUF_IQ2_XXS.ksigns, dtype=np.uint8).copy()
    return torch.from_numpy(grid), torch.from_numpy(ksigns)


def _native_pairs(qtype: QuantType) -> PairsKernel | None:
    name = _NATIVE.get(qtype)
    extension = native_extension() if name is not None else None
    if extension is None:
        return None
    function = getattr(extension, name)
    tables = _iq2_tables() if qtype is QuantType.IQ2_XXS else ()

    label = f"ds4_vllm::{name}"  # named in torch.profiler's tables, which skip pybind calls

    def pairs(x: torch.Tensor, data: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function(label):
            return function(x.contiguous(), data.contiguous(), ids.to(torch.int64), *tables)

    return pairs


def _one_matrix(pairs: PairsKernel) -> LinearKernel:
    """A pairs kernel as a linear one: every row through the one matrix ``data`` [N, row bytes]."""

    def linear(x: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        return pairs(x, data.unsqueeze(0), torch.zeros(x.shape[0], dtype=torch.int64, device=x.device))

    return linear


__all__ = [
    "FUSED_TYPES",
    "MAX_PAIRS",
    "MAX_ROWS",
    "NATIVE_MAX_ROWS",
    "FusedKernels",
    "build_native_extension",
    "compile_enabled",
    "kernels_for",
    "linear_kernel",
    "native_extension",
    "pairs_kernel",
]
