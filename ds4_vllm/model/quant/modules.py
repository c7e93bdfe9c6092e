"""Linear layers and routed-expert stacks whose weights stay packed until they are used.

How the model uses them
-----------------------
- Dense projections (attention ``wq_a``/``wq_b``/``wkv``/``wo_a``/``wo_b``, shared experts,
  ``head``): build ``QuantLinear(in_features, out_features)`` instead of ``nn.Linear``. It holds
  no weight until the loader calls ``set_weight(tensor_or_quantized_weight)``; ``forward(x)``
  dequantizes to ``x.dtype`` and calls ``F.linear``.
- Routed experts: build ``QuantExperts(n_experts, hidden, ffn, limit)`` instead of the float
  ``Experts``. The loader fills ``gate_proj`` (w1, [E, ffn, hidden]), ``up_proj`` (w3,
  [E, ffn, hidden]) and ``down_proj`` (w2, [E, hidden, ffn]) with ``set_weight`` (a whole GGUF
  stack) or ``set_expert(e, w)`` (one safetensors expert at a time; packed storage for the
  stack is allocated once, at the packed size). ``forward(x, indices, weights)`` has the float
  ``Experts`` semantics and dequantizes only the experts the batch selected, a few at a time.
  A transformers-style float ``gate_up_proj`` [E, 2*ffn, hidden] goes in as its two halves
  (``w[:, :ffn]`` to gate, ``w[:, ffn:]`` to up).
- ``.to(device)`` moves the packed bytes; ``.to(dtype)`` leaves packed bytes alone and casts
  plain float weights only.

Where fused kernels plug in
---------------------------
A layer's ``fused`` (`quant.fused.FusedKernels`, bound per format by
`ds4_vllm.model.cpu_kernels` on a CPU) takes dense and grouped projections of up to
``max_rows`` rows and routed experts of up to ``max_pairs`` (token, expert) pairs without
dequantizing; larger batches and layers without one go through ``quant_linear(x, weight)`` and
``QuantExperts.expert_forward``. A GPU kernel would plug in the same way, without touching the
modules' storage or loaders.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ds4_vllm.model.parallel import Split, take_part
from ds4_vllm.model.quant import QuantizedWeight, QuantType, packed_shape, scale_shape
from ds4_vllm.model.quant.dequant import IndexLike, dequantize
from ds4_vllm.model.quant.fused import FusedKernels

WeightLike = torch.Tensor | QuantizedWeight


#: Float bytes of one row block of a packed weight when few tokens pass through it on a CPU: the
#: block is dequantized and multiplied while it is still in the CPU's cache, and no full-size
#: float copy is allocated (on a GPU, hundreds of small kernel launches would cost more).
#: Measured on a [16,160, 4,096] Q8_0 weight, one token: 0.054 s in 8 MiB blocks against
#: 0.20 s whole (a decode step's LM head of the real-width slice, 0.73 s whole).
ROW_BLOCK_BYTES = 8 << 20
#: Up to this many tokens the row blocks are faster (measured 1 to 256; at 2,048, a prefill
#: chunk, the whole weight is faster: the matmul dominates and reuses one dequantization).
ROW_BLOCK_MAX_TOKENS = 256
#: Tokens per product of a grouped projection (`QuantLinear.grouped`) with a float weight: the
#: product copies its input once more, 256 MiB for a 2,048-token chunk at real widths in one go.
GROUPED_TOKEN_BLOCK = 256
#: Off the CPU, steps with at most this many (token, expert) pairs gather each pair's expert
#: weights on the device (`QuantExperts._forward_gathered`): a decode batch of 32 at top-6.
GATHERED_PAIRS = 192


def quant_linear(x: torch.Tensor, weight: WeightLike, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with a weight that may be packed: dequantized to ``x.dtype`` for this call only.

    On a CPU, a large packed 2-D weight used by a few tokens (decode) is dequantized and applied
    in row blocks of ``ROW_BLOCK_BYTES``; the values are the same, the sums may round
    differently in the last bits (the BLAS kernel's blocking depends on the output width).
    """
    if not isinstance(weight, QuantizedWeight):
        return F.linear(x, weight.to(x.dtype), bias)
    out_features, in_features = weight.shape[-2], weight.shape[-1]
    rows = max(1, ROW_BLOCK_BYTES // (4 * in_features))
    tokens = x.numel() // max(1, in_features)
    if (
        x.device.type != "cpu"
        or len(weight.shape) != 2
        or weight.qtype in (QuantType.F32, QuantType.F16, QuantType.BF16)
        or out_features <= rows
        or tokens > ROW_BLOCK_MAX_TOKENS
    ):
        return F.linear(x, dequantize(weight, dtype=x.dtype), bias)
    out = x.new_empty(*x.shape[:-1], out_features)
    for start in range(0, out_features, rows):
        stop = min(start + rows, out_features)
        block = dequantize(weight, index=torch.arange(start, stop, device=x.device), dtype=x.dtype)
        out[..., start:stop] = F.linear(x, block, None if bias is None else bias[start:stop])
    return out


class _PackedWeightHolder(nn.Module):
    """Buffers for one weight of logical shape ``shape``: a float tensor or packed bytes + scales.

    The buffers are ``weight`` (float weights), or ``weight_packed`` and ``weight_scale``
    (packed); the unused ones are None. Before ``set_weight`` all three are None (not a meta
    tensor, which ``Module.to(device)`` cannot copy), so constructing a model allocates nothing.
    A weight is stored on the device the module was built on (`device`): vLLM builds the model
    under its target device and hands ``load_weights`` CPU tensors.
    """

    def __init__(self, shape: tuple[int, ...], name: str, split: Split | None = None) -> None:
        super().__init__()
        #: The checkpoint's logical shape, and this rank's part of it under tensor parallelism.
        self.full_shape = tuple(int(d) for d in shape)
        self.split = split
        self.shape = split.local_shape(self.full_shape) if split is not None else self.full_shape
        self.name = name
        self.qtype: QuantType | None = None
        self.register_buffer("weight", None)
        self.register_buffer("weight_packed", None)
        self.register_buffer("weight_scale", None)
        # Empty, so it costs nothing; it follows the module through `.to(device)`.
        self.register_buffer("_device_anchor", torch.empty(0, dtype=torch.uint8), persistent=False)

    @property
    def device(self) -> torch.device:
        """Where this module's weight lives (and is moved to when set)."""
        return self._device_anchor.device

    @property
    def is_loaded(self) -> bool:
        return self.qtype is not None or self.weight is not None

    def _local(self, w: WeightLike) -> WeightLike:
        """This rank's part of a whole checkpoint weight (the weight itself without a split)."""
        if self.split is None or not isinstance(w, (torch.Tensor, QuantizedWeight)):
            return w
        if tuple(w.shape) != self.full_shape:
            raise ValueError(f"{self.name}: weight has shape {tuple(w.shape)}, expected {self.full_shape}")
        return take_part(w, self.split, self.name)

    def _store(self, w: WeightLike) -> None:
        if isinstance(w, QuantizedWeight):
            if w.shape != self.shape:
                raise ValueError(
                    f"{self.name}: {w.qtype.value} weight has logical shape {w.shape}, expected {self.shape}"
                )
            self.qtype = w.qtype
            self.weight = None
            self.weight_packed = w.data.to(self.device)
            self.weight_scale = None if w.scale is None else w.scale.to(self.device)
        elif isinstance(w, torch.Tensor):
            if tuple(w.shape) != self.shape:
                raise ValueError(f"{self.name}: weight has shape {tuple(w.shape)}, expected {self.shape}")
            if not w.dtype.is_floating_point:
                raise TypeError(
                    f"{self.name}: a plain weight must be a float tensor, got {w.dtype} "
                    "(wrap packed bytes in a QuantizedWeight)"
                )
            self.qtype = None
            self.weight = w.to(self.device)
            self.weight_packed = None
            self.weight_scale = None
        else:
            raise TypeError(f"{self.name}: expected a tensor or QuantizedWeight, got {type(w).__name__}")

    def stored_weight(self) -> WeightLike:
        """The weight as stored: the float tensor, or a QuantizedWeight over the packed buffers."""
        if not self.is_loaded:
            raise RuntimeError(f"{self.name}: weight was never set (call set_weight first)")
        if self.qtype is None:
            return self.weight
        return QuantizedWeight(self.qtype, self.shape, self.weight_packed, self.weight_scale)

    @property
    def nbytes(self) -> int:
        """Resident bytes of the stored weight (0 before it is set)."""
        if not self.is_loaded:
            return 0
        w = self.stored_weight()
        return w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()

    def extra_repr(self) -> str:
        kind = (
            self.qtype.value
            if self.qtype is not None
            else (str(self.weight.dtype) if self.is_loaded else "unset")
        )
        return f"shape={self.shape}, weight={kind}"


class QuantLinear(_PackedWeightHolder):
    """A bias-free linear layer (``y = x @ W.T``) whose weight may stay packed.

    Under tensor parallelism ``split`` keeps this rank's output rows (axis 0: the output is this
    rank's slice) or input columns (axis 1: the input is this rank's slice and the output a
    partial sum the caller all-reduces).
    """

    def __init__(self, in_features: int, out_features: int, split: Split | None = None) -> None:
        super().__init__((out_features, in_features), "QuantLinear", split)
        self.out_features, self.in_features = self.shape
        #: A faster GEMM bound to this layer's float CPU weight (`ds4_vllm.model.cpu_kernels`), used
        #: for CPU inputs of the weight's dtype; None: `quant_linear`.
        self.fast_linear: Callable[[torch.Tensor], torch.Tensor] | None = None
        #: `project` as an op opaque to torch.compile, for packed weights under vLLM
        #: (`ds4_vllm.model.step_ops`): their unpacking reads values on the host. None: called directly.
        self.packed_op: Callable[[torch.Tensor, int], torch.Tensor] | None = None
        #: Fused dequantize-and-multiply kernels for this layer's packed CPU weight, used for up to
        #: their ``max_rows`` rows (`ds4_vllm.model.cpu_kernels`); None: `quant_linear`.
        self.fused: FusedKernels | None = None

    @property
    def is_packed(self) -> bool:
        return self.qtype is not None

    def set_weight(self, w: WeightLike) -> None:
        """Install the whole checkpoint's [out, in] weight (this rank keeps its part): float or packed."""
        self._store(self._local(w))
        self.fast_linear = self.fused = None  # bound to the previous weight

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a float tensor of ``dtype`` (a new tensor for packed weights)."""
        w = self.stored_weight()
        return dequantize(w, dtype=dtype) if isinstance(w, QuantizedWeight) else w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_op is not None:
            return self.packed_op(x, 0)
        return self.project(x, 0)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """[t, g, in/g] -> [t, g, out/g]: group ``j`` of the input through rows ``j`` of the
        output (a block-diagonal weight, as DeepSeek V4's grouped output projection)."""
        if self.packed_op is not None:
            return self.packed_op(x, x.shape[1])
        return self.project(x, x.shape[1])

    def project(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """``forward`` (``groups`` 0) or ``grouped`` (``groups``: x's dim 1), computed here."""
        fused = self.fused
        if fused is not None and x.device.type == "cpu":
            # Rows that read the same weight rows: a grouped projection's groups read apart.
            rows = x.shape[0] if groups else x.numel() // x.shape[-1]
            if rows <= fused.max_rows:
                return fused.project(x, self.weight_packed, groups)
        if groups:
            weight = self.dequantized_weight(x.dtype).view(groups, -1, x.shape[-1])
            if x.shape[0] <= GROUPED_TOKEN_BLOCK or torch.compiler.is_compiling():  # one graph for any length
                return torch.einsum("tgi,goi->tgo", x, weight)
            # In token blocks: the product's batched matmul copies its [g, t, in/g] input.
            out = x.new_empty(x.shape[0], groups, weight.shape[1])
            for start in range(0, x.shape[0], GROUPED_TOKEN_BLOCK):
                block = slice(start, start + GROUPED_TOKEN_BLOCK)
                out[block] = torch.einsum("tgi,goi->tgo", x[block], weight)
            return out
        fast = self.fast_linear
        if fast is not None and x.device.type == "cpu" and x.dtype == self.weight.dtype:
            return fast(x)
        return quant_linear(x, self.stored_weight())


class QuantExpertWeight(_PackedWeightHolder):
    """One stacked routed-expert projection of logical shape [n_experts, out, in]."""

    def __init__(
        self,
        n_experts: int,
        out_features: int,
        in_features: int,
        name: str = "experts",
        experts: range | None = None,
    ) -> None:
        split = None if experts is None or len(experts) == n_experts else Split(0, experts, n_experts)
        super().__init__((n_experts, out_features, in_features), name, split)
        #: Global ids of the experts this rank holds (all of them without expert parallelism).
        self.experts = range(n_experts) if experts is None else experts
        #: Which local experts were installed: loader bookkeeping, kept on the host (no device sync).
        self._expert_set = [False] * self.shape[0]
        #: Per local expert, a faster GEMM bound to its float CPU weight (`ds4_vllm.model.cpu_kernels`).
        self.fast_linears: list[Callable[[torch.Tensor], torch.Tensor]] | None = None
        #: Fused dequantize-and-multiply kernels for the packed CPU stack (`ds4_vllm.model.cpu_kernels`).
        self.fused: FusedKernels | None = None

    @property
    def n_experts(self) -> int:
        """Experts in the checkpoint's stack (this rank holds `experts` of them)."""
        return self.full_shape[0]

    def set_weight(self, w: WeightLike) -> None:
        """Install the whole [E, out, in] stack (e.g. a GGUF ``ffn_*_exps`` tensor); this rank keeps its experts."""
        self._store(self._local(w))
        self._expert_set = [True] * self.shape[0]
        self.fast_linears = self.fused = None  # bound to the previous weights

    def set_expert(self, expert: int, w: WeightLike) -> None:
        """Install one expert's [out, in] weight by global id (ignored when another rank holds it);
        packed storage for the stack is allocated on first use."""
        if not 0 <= expert < self.n_experts:
            raise IndexError(f"{self.name}: expert {expert} is out of range for {self.n_experts} experts")
        if expert not in self.experts:
            return
        expert -= self.experts.start
        one_shape = self.shape[1:]
        self.fast_linears = self.fused = None  # bound to the previous weights
        if isinstance(w, QuantizedWeight):
            if w.shape != one_shape:
                raise ValueError(
                    f"{self.name}[{expert}]: {w.qtype.value} weight has logical shape {w.shape}, expected {one_shape}"
                )
            if not self._allocated_for(w.qtype, torch.uint8):
                self._allocate_packed(w)
            self.weight_packed[expert].copy_(w.data)
            if w.scale is not None:
                self.weight_scale[expert].copy_(w.scale)
        elif isinstance(w, torch.Tensor):
            if tuple(w.shape) != one_shape:
                raise ValueError(
                    f"{self.name}[{expert}]: weight has shape {tuple(w.shape)}, expected {one_shape}"
                )
            if not w.dtype.is_floating_point:
                raise TypeError(
                    f"{self.name}[{expert}]: a plain weight must be a float tensor, got {w.dtype}"
                )
            if not self._allocated_for(None, w.dtype):
                self._store(torch.empty(self.shape, dtype=w.dtype, device=self.device))
                self._expert_set = [False] * self.shape[0]
            self.weight[expert].copy_(w)
        else:
            raise TypeError(
                f"{self.name}[{expert}]: expected a tensor or QuantizedWeight, got {type(w).__name__}"
            )
        self._expert_set[expert] = True

    def _allocated_for(self, qtype: QuantType | None, dtype: torch.dtype) -> bool:
        """Whether the stack's storage already holds experts of this kind; a different kind is an error."""
        if not self.is_loaded:
            return False
        stored = self.qtype.value if self.qtype is not None else str(self.weight.dtype)
        wanted = qtype.value if qtype is not None else str(dtype)
        if stored != wanted:
            loaded = [self.experts[i] for i, done in enumerate(self._expert_set) if done][:4]
            raise ValueError(
                f"{self.name}: experts {loaded}... are {stored}, this one is {wanted}; "
                "all experts of a stack must share one type"
            )
        return True

    def _allocate_packed(self, one: QuantizedWeight) -> None:
        device = self.device
        data = torch.empty(packed_shape(one.qtype, self.shape), dtype=torch.uint8, device=device)
        want_scale = scale_shape(one.qtype, self.shape)
        scale = None if want_scale is None else torch.empty(want_scale, dtype=torch.uint8, device=device)
        self._store(QuantizedWeight(one.qtype, self.shape, data, scale))
        self._expert_set = [False] * self.shape[0]

    def missing_experts(self) -> list[int]:
        """Global ids of this rank's experts not installed yet (a loader checks this is empty before serving)."""
        return [self.experts[i] for i, done in enumerate(self._expert_set) if not done]

    def expert_weights(
        self, ids: IndexLike, dtype: torch.dtype = torch.float32, check_index: bool = True
    ) -> torch.Tensor:
        """Float weights of the experts ``ids`` ([len(ids), out, in]); only those are dequantized.

        ``check_index=False``: the caller has clamped ``ids`` into range (the check reads them back).
        """
        w = self.stored_weight()
        if isinstance(w, QuantizedWeight):
            return dequantize(w, index=ids, dtype=dtype, check_index=check_index)
        if not isinstance(ids, torch.Tensor):
            ids = torch.as_tensor(ids, dtype=torch.int64)
        return w.index_select(0, ids.to(device=w.device, dtype=torch.int64)).to(dtype)


class QuantExperts(nn.Module):
    """Routed experts (SwiGLU with clamp ``limit``) with packed stacked weights.

    ``dequant_budget_bytes`` bounds the float weights dequantized at once: experts are
    processed in groups whose gate+up+down weights fit in it (at least one expert per group).
    It is transient memory on top of the packed weights, and the GGUF block decoders briefly
    need about twice their output, so it is kept small: 64 MiB is one DeepSeek V4 Flash expert
    in bfloat16 and all experts of the tiny models; larger groups only save Python overhead.

    Under expert parallelism this rank holds the experts ``experts`` (global ids) and adds only
    their contributions; the caller sums the ranks' outputs.
    """

    def __init__(
        self,
        n_experts: int,
        hidden: int,
        ffn: int,
        limit: float,
        dequant_budget_bytes: int = 64 << 20,
        experts: range | None = None,
    ) -> None:
        super().__init__()
        self.experts = range(n_experts) if experts is None else experts
        self.gate_proj = QuantExpertWeight(n_experts, ffn, hidden, "experts.gate_proj (w1)", self.experts)
        self.up_proj = QuantExpertWeight(n_experts, ffn, hidden, "experts.up_proj (w3)", self.experts)
        self.down_proj = QuantExpertWeight(n_experts, hidden, ffn, "experts.down_proj (w2)", self.experts)
        self.n_experts, self.hidden, self.ffn = n_experts, hidden, ffn
        self.limit = limit
        self.dequant_budget_bytes = dequant_budget_bytes

    def missing_experts(self) -> dict[str, list[int]]:
        """Per projection, the experts not installed yet (empty lists when fully loaded)."""
        return {p.name: p.missing_experts() for p in (self.gate_proj, self.up_proj, self.down_proj)}

    def experts_per_group(self, dtype: torch.dtype) -> int:
        per_expert = 3 * self.hidden * self.ffn * torch.empty((), dtype=dtype).element_size()
        return max(1, self.dequant_budget_bytes // per_expert)

    def expert_forward(
        self, x: torch.Tensor, gate: WeightLike, up: WeightLike, down: WeightLike, stored: int | None = None
    ) -> torch.Tensor:
        """One expert on its tokens ``x`` [n, hidden] with weights gate/up [ffn, hidden], down [hidden, ffn].

        ``stored``: the local index of the expert when the weights are its stored float weights
        (not a dequantized copy), so that GEMMs bound to them (`fast_linears`) may run instead.
        """
        g = self._project(self.gate_proj, stored, x, gate).clamp(max=self.limit)
        u = self._project(self.up_proj, stored, x, up).clamp(min=-self.limit, max=self.limit)
        return self._project(self.down_proj, stored, F.silu(g) * u, down)

    @staticmethod
    def _project(
        proj: QuantExpertWeight, stored: int | None, x: torch.Tensor, weight: WeightLike
    ) -> torch.Tensor:
        fast = proj.fast_linears
        if (
            fast is not None
            and stored is not None
            and x.device.type == "cpu"
            and isinstance(weight, torch.Tensor)
            and x.dtype == weight.dtype
        ):
            return fast[stored](x)
        return quant_linear(x, weight)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` [tokens, hidden]; ``indices``/``weights`` [tokens, top_k] from the router."""
        if x.device.type != "cpu" and indices.numel() <= GATHERED_PAIRS:
            return self._forward_gathered(x, indices, weights)
        fused = self._fused_kernels(x)
        if fused is None and x.shape[0] == 1:
            if (out := self._forward_one_token(x, indices[0], weights[0])) is not None:
                return out
        out = torch.zeros_like(x)
        top_k = indices.shape[1]
        flat = indices.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        used = counts.nonzero().flatten()
        if len(self.experts) < self.n_experts:  # expert parallel: this rank's experts only
            used = used[(used >= self.experts.start) & (used < self.experts.stop)]
        starts = torch.cumsum(counts, 0) - counts
        token_of, slot_of = order // top_k, order % top_k
        if fused is not None:  # experts with few tokens: their packed bytes read once, in one call
            few = counts[used] <= fused.max_rows
            self._experts_fused(x, weights, used[few], counts, starts, token_of, slot_of, out)
            used = used[~few]
        starts_list, counts_list = starts[used].tolist(), counts[used].tolist()
        for pairs, (gate, up, down), in_place in self._weight_groups(used - self.experts.start, x.dtype):
            for j, w_index in pairs:
                start, count = starts_list[j], counts_list[j]
                tokens = token_of[start : start + count]
                slots = slot_of[start : start + count]
                stored = w_index if in_place else None
                y = self.expert_forward(x[tokens], gate[w_index], up[w_index], down[w_index], stored)
                out.index_add_(0, tokens, y * weights[tokens, slots, None].to(x.dtype))
        return out

    def _fused_kernels(self, x: torch.Tensor) -> FusedKernels | None:
        """The fused kernels of the packed CPU stacks, when all three projections have them."""
        kernels = [p.fused for p in (self.gate_proj, self.up_proj, self.down_proj)]
        if x.device.type != "cpu" or any(k is None for k in kernels):
            return None
        return min(kernels, key=lambda k: k.max_rows)  # type: ignore[union-attr]

    def _experts_fused(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        counts: torch.Tensor,
        starts: torch.Tensor,
        token_of: torch.Tensor,
        slot_of: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Experts ``experts`` (global ids, ascending) on their tokens through the fused kernels,
        added into ``out`` as the loop of `forward` adds them (pairs in expert order).

        ``counts``/``starts``: per expert, its pairs in ``token_of``/``slot_of`` (pairs sorted by expert).
        """
        if experts.numel() == 0:
            return
        n = counts[experts]
        # The sorted pairs of these experts: pair i of expert e is entry starts[e] + i.
        first = torch.repeat_interleave(starts[experts] - (torch.cumsum(n, 0) - n), n)
        pairs = first + torch.arange(first.numel())
        tokens, slots = token_of[pairs], slot_of[pairs]
        matrix = experts - self.experts.start
        bounds = torch.cat((n.new_zeros(1), torch.cumsum(n, 0)))
        rows = x[tokens]
        g = self.gate_proj.fused.matrices(rows, self.gate_proj.weight_packed, matrix, bounds)
        u = self.up_proj.fused.matrices(rows, self.up_proj.weight_packed, matrix, bounds)
        h = F.silu(g.clamp(max=self.limit)) * u.clamp(min=-self.limit, max=self.limit)
        y = self.down_proj.fused.matrices(h, self.down_proj.weight_packed, matrix, bounds)
        out.index_add_(0, tokens, y * weights[tokens, slots, None].to(x.dtype))

    def _forward_gathered(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Each (token, expert) pair through its expert's weights, read where they lie: nothing
        is read back to the host and the shapes do not depend on the routing (what a CUDA graph
        needs). Each pair's weights are gathered and dequantized on the accelerator, so each
        picked expert is read once per pair rather than once per step as in the general path;
        for prefill-sized batches that would cost too much.
        """
        tokens, top_k = indices.shape
        local = indices.flatten() - self.experts.start
        mine = (local >= 0) & (local < len(self.experts))  # expert parallel: this rank's experts only
        local = local.clamp(0, len(self.experts) - 1)
        rows = x.repeat_interleave(top_k, dim=0, output_size=tokens * top_k)
        g = self._pairs_through(self.gate_proj, rows, local).clamp(max=self.limit)
        u = self._pairs_through(self.up_proj, rows, local).clamp(min=-self.limit, max=self.limit)
        y = self._pairs_through(self.down_proj, F.silu(g) * u, local)
        scale = (weights.flatten() * mine).to(x.dtype).unsqueeze(-1)
        return (y * scale).view(tokens, top_k, -1).sum(dim=1)

    @staticmethod
    def _pairs_through(proj: QuantExpertWeight, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Row p of ``rows`` [P, in] through local expert ``local[p]`` of ``proj`` -> [P, out]."""
        w = proj.expert_weights(local, rows.dtype, check_index=False)
        return torch.bmm(w, rows.unsqueeze(-1)).squeeze(-1)

    def _forward_one_token(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor | None:
        """A batch-1 decode step: the token's experts in ascending id order, as the general path adds them.

        Same float operations as `forward` (per expert ``out += y * w`` from zeros, ascending ids),
        without its sort, bincount and index bookkeeping, which cost more than the experts here.
        Packed matrices larger than a row block of `quant_linear` are applied block by block, so
        their sums may round differently from `forward`'s in the last bits.
        """
        slot_of = {e: k for k, e in enumerate(indices.tolist())}
        if len(slot_of) < indices.shape[0]:  # an expert picked twice: the general path sums both
            return None
        out = torch.zeros_like(x)
        expert_ids = sorted(e for e in slot_of if e in self.experts)
        scaled = weights.to(x.dtype)
        stored = tuple(p.stored_weight() for p in (self.gate_proj, self.up_proj, self.down_proj))
        if x.device.type == "cpu" and any(isinstance(w, QuantizedWeight) for w in stored):
            # Packed: each weight goes to quant_linear whole, which on a CPU dequantizes a large
            # one in cache-sized row blocks (a real-width expert matrix is 32 MiB of float32).
            for e in expert_ids:
                local = e - self.experts.start
                parts = (w.entry(local) if isinstance(w, QuantizedWeight) else w[local] for w in stored)
                out.add_(self.expert_forward(x, *parts) * scaled[slot_of[e]])
            return out
        local_ids = torch.tensor([e - self.experts.start for e in expert_ids], dtype=torch.int64)
        for pairs, (gate, up, down), in_place in self._weight_groups(local_ids, x.dtype):
            for j, w_index in pairs:
                stored = w_index if in_place else None
                y = self.expert_forward(x, gate[w_index], up[w_index], down[w_index], stored)
                out.add_(y * scaled[slot_of[expert_ids[j]]])
        return out

    def _weight_groups(self, used: torch.Tensor, dtype: torch.dtype):
        """(positions in ``used`` paired with the weight index of that expert, (gate, up, down),
        whether those are the stored weights indexed by local expert) per group.

        Float weights already of ``dtype`` are indexed in place (one view per expert, nothing copied
        per step: a decode step would otherwise copy its experts' weights every layer); packed ones
        are dequantized group by group within ``dequant_budget_bytes``, or, where one expert does
        not fit in it, left packed for `quant_linear` to dequantize a projection at a time.
        """
        stored = tuple(p.stored_weight() for p in (self.gate_proj, self.up_proj, self.down_proj))
        if all(isinstance(w, torch.Tensor) and w.dtype == dtype for w in stored):
            yield list(enumerate(used.tolist())), stored, True
            return
        group = self.experts_per_group(dtype)
        if group == 1 and all(isinstance(w, QuantizedWeight) for w in stored):
            # Experts too large to dequantize together (one real-width expert is 96 MiB in
            # float32): each projection is dequantized where it is used, one at a time.
            for j, e in enumerate(used.tolist()):
                yield [(j, 0)], tuple([w.entry(e)] for w in stored), False
            return
        for g0 in range(0, used.numel(), group):
            ids = used[g0 : g0 + group]
            weights = tuple(
                p.expert_weights(ids, dtype) for p in (self.gate_proj, self.up_proj, self.down_proj)
            )
            yield [(g0 + j, j) for j in range(ids.numel())], weights, False
