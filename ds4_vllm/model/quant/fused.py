"""Packed GGUF weights applied to rows of activations without a float copy of the weight.

The kernels take segments of rows, each segment through one matrix of a packed stack
(`SegmentsKernel`): a linear layer is one segment, a grouped projection one per group, routed
experts one per expert with its tokens. Two implementations, picked per format (`kernels_for`):

- A C++ loop (``packed_cpu.cpp``, `native_extension`; Q8_0, Q2_K, Q4_K, IQ2_XXS, F16, BF16):
  a task decodes a few weight rows once into float values (`dequant.py`'s values) and multiplies
  them with every row of the segment; a segment of one or two rows runs the format's dot loop
  over the packed bytes instead where it has one (Q8_0, IQ2_XXS). Worth it up to
  `NATIVE_MAX_ROWS` rows per matrix.
- Where that loop cannot be built (no compiler, no AVX2), tensor expressions of the formats
  (Q8_0, Q2_K, IQ2_XXS, F16, BF16) that read the packed bytes, decode them and reduce against
  the activations, which Inductor fuses into one loop over the weight's bytes; run eagerly they
  would materialize a [rows, out, in] product, so only compiled kernels are handed out
  (`linear_kernel`, `pairs_kernel`). They read the weight once per row (`MAX_ROWS`).

Both are off where torch.compile is disabled, as all of the compiled path. Per block the
arithmetic is the format's (`dequant.py` stays the reference), so results differ from
"dequantize, then matmul" by float32 summation order only.

Measured on the 2-core AVX-512 machine, one row through a [2048, 4096] weight (8M values): C++
IQ2_XXS 1.0 ms, Q4_K 1.2 ms, Q2_K [4096, 2048] 1.6 ms, Q8_0 [4096, 4096] 0.9 ms; Inductor Q8_0 0.7 ms, Q2_K
1.4-2.5 ms, IQ2_XXS 3.2-6.6 ms (its grid lookups vectorize poorly); against 11-30 ms to
dequantize it eagerly and multiply, and 1.7 ms for float32 weights in ``F.linear`` (0.6 ms bf16).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from ds4_vllm.model.quant import QuantType
from ds4_vllm.model.quant.dequant import _table

logger = logging.getLogger(__name__)

#: Rows per weight matrix up to which the Inductor kernels beat dequantizing the weight and
#: multiplying: they read the weight once per row. Measured for the 129,280 x 256 Q8_0 head:
#: 4.7 / 18.7 / 29.7 ms fused for 1 / 4 / 8 rows against 44.6 / 32.8 / 30.5 ms; for a
#: [4096, 1024] weight 0.40 / 1.47 / 3.44 against 1.94 / 3.32 / 3.34 ms; routed IQ2_XXS experts
#: break even at 2 rows per expert.
MAX_ROWS = 2
#: The same for the C++ loops (`native_extension`), which decode a weight row once for all the
#: rows that go through its matrix. Measured per [2048, 4096] matrix (1 / 8 / 32 / 64 rows):
#: IQ2_XXS 1.0 / 4.3 / 13.3 / 25.7 ms against 23-30 ms dequantized and multiplied; Q2_K
#: [4096, 2048] 1.6 / 2.8 / 14.6 / 28.9 against 18.6-26.8 ms; Q8_0 [4096, 4096] 0.9 / 8.8 / 30.0
#: / 50.0 against 29.8-45.0 ms.
NATIVE_MAX_ROWS = 32

LinearKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PairsKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``(x [P, K] float32, data [E, N, row bytes], matrix [S], starts [S + 1]) -> [P, N]``: rows
#: ``starts[s]:starts[s + 1]`` of x through matrix ``matrix[s]`` of the packed stack; with
#: matrix and starts None, every row through the one matrix data [N, row bytes].
SegmentsKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor
]


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
    """The kernels of one block format, as the model's layers call them."""

    qtype: QuantType
    segments: SegmentsKernel
    #: Rows per weight matrix up to which these beat dequantizing and multiplying.
    max_rows: int
    #: Inductor's kernels, compiled on first use for each shape Dynamo tells apart (else the C++ loop).
    compiled: bool

    def project(self, x: torch.Tensor, data: torch.Tensor, groups: int = 0) -> torch.Tensor:
        """``x @ W.T`` for packed rows ``data`` [out, row bytes] (``groups`` 0), or the grouped
        projection: x [t, g, in / g], group j through rows j of the g equal row blocks."""
        if groups:
            t = x.shape[0]
            rows = x.transpose(0, 1).reshape(groups * t, x.shape[-1]).float()
            matrix = torch.arange(groups, device=x.device)
            out = self.segments(
                rows,
                data.view(groups, -1, data.shape[-1]),
                matrix,
                torch.arange(0, groups * t + 1, t, device=x.device),
            )
            return out.view(groups, t, -1).transpose(0, 1).to(x.dtype)
        out = self.segments(x.reshape(-1, x.shape[-1]).float(), data, None, None)
        return out.view(*x.shape[:-1], -1).to(x.dtype)

    def matrices(
        self, x: torch.Tensor, data: torch.Tensor, matrix: torch.Tensor, starts: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``starts[s]:starts[s + 1]`` of x [P, in] through matrix ``matrix[s]`` of the packed
        stack ``data`` [E, out, row bytes] -> [P, out]."""
        return self.segments(x.float(), data, matrix, starts).to(x.dtype)


def kernels_for(qtype: QuantType) -> FusedKernels | None:
    """The fused kernels of a format; None without a kernel or with torch.compile off."""
    if not compile_enabled():
        return None
    native = _native_segments(qtype)
    if native is not None:
        return FusedKernels(qtype, native, NATIVE_MAX_ROWS, compiled=False)
    linear, pairs = linear_kernel(qtype), pairs_kernel(qtype)
    if linear is None or pairs is None:
        return None
    return FusedKernels(qtype, _inductor_segments(linear, pairs), MAX_ROWS, compiled=True)


def _inductor_segments(linear: LinearKernel, pairs: PairsKernel) -> SegmentsKernel:
    """Segments through the Inductor kernels: one matrix is a linear layer, else row by row."""

    def segments(
        x: torch.Tensor, data: torch.Tensor, matrix: torch.Tensor | None, starts: torch.Tensor | None
    ) -> torch.Tensor:
        if matrix is None or starts is None:
            return linear(x, data)
        return pairs(x, data, matrix.repeat_interleave(starts.diff(), output_size=x.shape[0]))

    return segments


#: Formats of the C++ loop in ``packed_cpu.cpp``, with its format codes: faster than Inductor's
#: code for the expressions (IQ2_XXS: grid lookups, 1.75 against 7 ms per [2048, 4096] matrix;
#: Q8_0: the LM head), and they decode a row once for all rows through it.
_NATIVE_FORMATS = {
    QuantType.Q8_0: 0,
    QuantType.Q2_K: 1,
    QuantType.Q4_K: 2,
    QuantType.IQ2_XXS: 3,
    QuantType.F16: 4,
    QuantType.BF16: 5,
}
#: Formats with Inductor kernels, with the C++ loop, with either.
INDUCTOR_TYPES = frozenset(_FORMATS)
NATIVE_TYPES = frozenset(_NATIVE_FORMATS)
FUSED_TYPES = INDUCTOR_TYPES | NATIVE_TYPES


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


_NO_TABLE = torch.empty(0, dtype=torch.uint8)
#: Whether torch.profiler is recording (a ``record_function`` costs ~8 us, a small matrix's product).
_profiling = torch._C._autograd._profiler_enabled


def _iq2_xxs_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """The IQ2_XXS tables as the C++ loop reads them, from the signed grid (row g * 128 + p: grid
    row g with sign pattern p): the magnitudes [256, 8] (pattern 0 has no signs) and the
    patterns [128] as bytes (bit j: value j is negative)."""
    grid = _IQ2_GRID[::128].abs().to(torch.uint8).contiguous()
    negative = (_IQ2_GRID[:128] < 0).to(torch.int32)
    ksigns = (negative << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)
    return grid, ksigns


def _native_segments(qtype: QuantType, extension=None) -> SegmentsKernel | None:
    """The C++ segments loop for a format (of ``extension``, default `native_extension`), or None."""
    code = _NATIVE_FORMATS.get(qtype)
    if code is None:
        return None
    extension = extension or native_extension()
    if extension is None:
        return None
    grid, ksigns = _iq2_xxs_tables() if qtype is QuantType.IQ2_XXS else (_NO_TABLE, _NO_TABLE)

    label = f"ds4_vllm::segments_{qtype.value}"

    def segments(
        x: torch.Tensor, data: torch.Tensor, matrix: torch.Tensor | None, starts: torch.Tensor | None
    ) -> torch.Tensor:
        args = (code, x.contiguous(), data.contiguous(), matrix, starts, grid, ksigns)
        if not _profiling():
            return extension.segments(*args)
        with torch.profiler.record_function(label):  # named in the profiler's tables, which skip pybind calls
            return extension.segments(*args)

    return segments


__all__ = [
    "FUSED_TYPES",
    "INDUCTOR_TYPES",
    "NATIVE_TYPES",
    "MAX_ROWS",
    "NATIVE_MAX_ROWS",
    "FusedKernels",
    "SegmentsKernel",
    "build_native_extension",
    "compile_enabled",
    "kernels_for",
    "linear_kernel",
    "native_extension",
    "pairs_kernel",
]
