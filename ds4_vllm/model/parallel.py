"""Tensor parallelism for `Ds4ForCausalLM`: which rank holds which slice, and the two collectives.

What splits and what stays whole (docs/tensor-parallel.md):
- split: query heads (``q_b_proj`` rows, ``sinks``), output groups (``o_a_proj`` rows,
  ``o_b_proj`` columns), routed experts (whole experts per rank: expert parallel), the shared
  expert's width, the vocabulary (embedding rows, LM head rows);
- whole on every rank: the shared KV head, compressors, indexer, hyper-connections, router and
  norms. So every rank's KV cache holds the same rows, and one checkpoint file serves any size.

vLLM's ``ColumnParallelLinear``/``RowParallelLinear`` carry vLLM's own quantization methods, which
do not know the packed GGUF / MXFP4 / FP8 block layouts these weights stay in; the slicing of
packed bytes is done here instead, and the communication is vLLM's (its tensor-parallel group
and ``tensor_model_parallel_all_reduce`` / ``_all_gather``). Outside a vLLM engine (a model built
directly, as the parity tests do) there is one rank and no collective runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ds4_vllm.model.quant import (
    FP8_BLOCK_SIZE,
    MXFP4_GROUP_SIZE,
    QuantizedWeight,
    QuantType,
    block_layout,
)

WeightLike = torch.Tensor | QuantizedWeight


@dataclass(frozen=True)
class TpGroup:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1

    @classmethod
    def current(cls) -> TpGroup:
        """vLLM's tensor-parallel group when an engine set one up, else a single rank."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
            model_parallel_is_initialized,
        )

        if not model_parallel_is_initialized():
            return cls()
        return cls(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())

    def part(self, total: int, what: str) -> range:
        """This rank's contiguous share of ``total`` items; ``what`` names them in the error."""
        if total % self.size:
            raise ValueError(
                f"tensor parallel size {self.size} does not divide {what} ({total}); "
                f"choose a size that divides it"
            )
        per = total // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial ``x``."""
        if self.size == 1:
            return x
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(x)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dim, in rank order."""
        if self.size == 1:
            return x
        from vllm.distributed import tensor_model_parallel_all_gather

        return tensor_model_parallel_all_gather(x, dim=-1)


#: One process, no collectives: a model built outside a vLLM engine.
SINGLE = TpGroup()


@dataclass(frozen=True)
class Split:
    """One weight's split: along ``axis`` of its logical shape (size ``total``), this rank keeps ``part``."""

    axis: int  # a non-negative axis of the logical shape
    part: range
    total: int

    def local_shape(self, whole: tuple[int, ...]) -> tuple[int, ...]:
        return self._with(whole, len(self.part))

    def whole_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return self._with(local, self.total)

    def _with(self, shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        out = list(shape)
        out[self.axis] = size
        return tuple(out)


def take_part(w: WeightLike, split: Split, name: str) -> WeightLike:
    """This rank's slice of a whole checkpoint weight.

    Copied, so the whole one can be freed, except a memory-mapped packed weight (GGUF): that
    part stays a view of the map, so each rank's pages are the page cache's, read once and
    shared, and the other ranks' parts are never read. Packed weights are cut between blocks:
    along the input dim at a multiple of the format's block (and scale group), along the output
    dim of FP8_BLOCK at a multiple of 128 rows.
    """
    lo, hi = split.part.start, split.part.stop
    if isinstance(w, torch.Tensor):
        return w.narrow(split.axis, lo, hi - lo).clone()
    ndim = len(w.shape)
    last, rows = ndim - 1, ndim - 2
    data, scale = w.data, w.scale
    if split.axis == last:
        per_block, nbytes = block_layout(w.qtype)
        group = {QuantType.MXFP4: MXFP4_GROUP_SIZE, QuantType.FP8_BLOCK: FP8_BLOCK_SIZE}.get(
            w.qtype, per_block
        )
        _aligned(lo, hi, w.shape[last], math.lcm(group, per_block), name, w.qtype, "input columns")
        data = data[..., lo // per_block * nbytes : hi // per_block * nbytes]
        if w.qtype is QuantType.MXFP4:
            scale = scale[..., lo // MXFP4_GROUP_SIZE : hi // MXFP4_GROUP_SIZE]
        elif w.qtype is QuantType.FP8_BLOCK:
            scale = scale[..., lo // FP8_BLOCK_SIZE : math.ceil(hi / FP8_BLOCK_SIZE)]
    else:
        index = (slice(None),) * split.axis + (slice(lo, hi),)
        data = data[index]
        if scale is not None and w.qtype is QuantType.FP8_BLOCK and split.axis == rows:
            _aligned(lo, hi, w.shape[rows], FP8_BLOCK_SIZE, name, w.qtype, "output rows")
            scale = scale[..., lo // FP8_BLOCK_SIZE : math.ceil(hi / FP8_BLOCK_SIZE), :]
        elif scale is not None:
            scale = scale[index]
    local = split.local_shape(w.shape)
    if w.mapped and data.is_contiguous() and scale is None:
        return QuantizedWeight(w.qtype, local, data, None, mapped=True)
    dense = torch.contiguous_format
    return QuantizedWeight(
        w.qtype,
        local,
        data.clone(memory_format=dense),
        None if scale is None else scale.clone(memory_format=dense),
    )


def _aligned(lo: int, hi: int, total: int, block: int, name: str, qtype: QuantType, what: str) -> None:
    if lo % block or (hi % block and hi != total):
        raise ValueError(
            f"{name}: {qtype.value} {what} {lo}..{hi} of {total} do not start and end on its "
            f"{block}-value blocks; this tensor cannot be split across the tensor-parallel ranks "
            f"(use a smaller --tensor-parallel-size)"
        )
