"""Cache-free building blocks of DeepSeek V4: norms, hyper-connections and the MoE FFN.

Module names mirror transformers' in-memory ``DeepseekV4ForCausalLM``; `weight_names` maps the
other checkpoint layouts onto them. Projections and routed experts are `model.quant` modules, so
quantized checkpoints stay packed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ds4_vllm.model.parallel import SINGLE, Split, TpGroup
from ds4_vllm.model.quant.modules import QuantExperts, QuantLinear


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm computed in float32 (as the reference does) and cast back."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)


def sinkhorn_(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn passes on ``comb`` [T, n, n] in place: a column step, then ``iters - 1`` row + column steps.

    Each step is ``comb / (comb.sum(dim) + eps)`` in float32. A decode step runs this 12 times
    with ~40 steps of tiny tensors each, so per-op overhead is the whole cost: on CPU the steps
    run in numpy on the same memory (bit-identical to torch's, see test_hyper_connection.py,
    and about 2.5x faster per call); elsewhere, and while torch.compile traces it (numpy is
    opaque to the graph), torch ops into preallocated sum buffers.
    """
    if (
        comb.device.type == "cpu"
        and comb.dtype == torch.float32
        and not comb.requires_grad
        and not torch.compiler.is_compiling()
    ):
        c = comb.numpy()
        eps32 = np.float32(eps)
        c /= c.sum(axis=-2, keepdims=True) + eps32
        for _ in range(iters - 1):
            c /= c.sum(axis=-1, keepdims=True) + eps32
            c /= c.sum(axis=-2, keepdims=True) + eps32
        return comb
    return sinkhorn_torch_(comb, iters, eps)


def sinkhorn_torch_(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn_` in torch ops (any device and dtype)."""
    rows = comb.new_empty(comb.shape[:-1] + (1,))
    cols = comb.new_empty(comb.shape[:-2] + (1, comb.shape[-1]))
    torch.sum(comb, dim=-2, keepdim=True, out=cols)
    comb.div_(cols.add_(eps))
    for _ in range(iters - 1):
        torch.sum(comb, dim=-1, keepdim=True, out=rows)
        comb.div_(rows.add_(eps))
        torch.sum(comb, dim=-2, keepdim=True, out=cols)
        comb.div_(cols.add_(eps))
    return comb


class HyperConnection(nn.Module):
    """mHC mixing for one sub-layer: collapse the streams (pre), then expand and mix (post, comb).

    State per token is ``[hc, hidden]``; ``comb`` is projected onto doubly-stochastic
    matrices with Sinkhorn passes, the first row step being the softmax.
    """

    def __init__(self, hc: int, hidden: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc) * hc
        self.fn = nn.Parameter(torch.zeros(width, hc * hidden))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3))
        #: Fused kernels for bf16 CPU streams (`ds4_vllm.model.cpu_kernels`); None: the code below.
        self.fast_forward: (
            Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None
        ) = None
        self.fast_expand: Callable[..., torch.Tensor] | None = None

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, H] -> (post [T, hc], comb [T, hc, hc], collapsed [T, H])."""
        if self.fast_forward is not None and _fused_streams(streams):
            return self.fast_forward(streams)
        hc = self.hc
        flat = rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1).add_(self.hc_eps)
        comb = sinkhorn_(comb, self.sinkhorn_iters, self.hc_eps)
        return post, comb, collapse(pre, streams)

    def expand(
        self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """X'_k = post_k * f(y) + sum_j comb[j, k] * X_j."""
        if self.fast_expand is not None and _fused_streams(streams):
            return self.fast_expand(out, streams, post, comb)
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        # In place: a prefill chunk's streams at real widths are 128 MiB in float32.
        return mixed.add_(post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2))


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_j pre[:, j] * streams[:, j], in streams' dtype: the same sums in the same order as
    ``(pre.unsqueeze(-1) * streams).sum(dim=1)``, without the [T, hc, H] float32 products (a
    prefill chunk's at real widths are 128 MiB)."""
    out = pre[:, 0, None] * streams[:, 0]
    for j in range(1, streams.shape[1]):
        out += pre[:, j, None] * streams[:, j]
    return out.to(streams.dtype)


def _fused_streams(streams: torch.Tensor) -> bool:
    """Streams vLLM's fused mHC CPU kernels take: bf16, on the CPU."""
    return streams.dtype == torch.bfloat16 and streams.device.type == "cpu"


class HyperHead(nn.Module):
    """Collapses the streams once more before the final norm and the LM head."""

    def __init__(self, hc: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * hidden))
        self.hc_base = nn.Parameter(torch.zeros(hc))
        self.hc_scale = nn.Parameter(torch.ones(1))
        self.fast_forward: Callable[[torch.Tensor], torch.Tensor] | None = None  # see HyperConnection

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        if self.fast_forward is not None and _fused_streams(streams):
            return self.fast_forward(streams)
        flat = rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return collapse(pre, streams)


def split_parameter(param: nn.Parameter, split: Split | None) -> nn.Parameter:
    """Mark a parameter as holding this rank's part of the checkpoint's tensor (the loader slices)."""
    param.tp_split = split
    return param


class ShardedEmbedding(nn.Module):
    """Token embedding whose rows (the vocabulary) are split across the tensor-parallel ranks."""

    def __init__(self, vocab: int, hidden: int, tp: TpGroup) -> None:
        super().__init__()
        self.tp = tp
        self.rows = tp.part(vocab, "the vocabulary size")
        split = Split(0, self.rows, vocab) if tp.size > 1 else None
        # Not filled here (nothing touched): the loader installs the checkpoint's table.
        self.weight = split_parameter(nn.Parameter(torch.empty(len(self.rows), hidden)), split)
        #: The loader may keep the table in the checkpoint's dtype when it is no wider than this
        #: one (a memory-mapped F16 table stays a view of the file); looked-up rows are converted.
        self.weight.keeps_checkpoint_dtype = True
        self.dtype = self.weight.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight).to(self.dtype)
        mine = (ids >= self.rows.start) & (ids < self.rows.stop)
        local = torch.where(mine, ids - self.rows.start, 0)
        out = F.embedding(local, self.weight).to(self.dtype) * mine.unsqueeze(-1).to(self.dtype)
        return self.tp.all_reduce(out)


class SharedExpert(nn.Module):
    """The always-on expert; under tensor parallelism each rank holds a slice of its width and
    returns a partial sum."""

    def __init__(self, hidden: int, ffn: int, limit: float, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        width = tp.part(ffn, "the expert width (moe_intermediate_size)")
        rows, cols = (Split(0, width, ffn), Split(1, width, ffn)) if tp.size > 1 else (None, None)
        self.gate_proj = QuantLinear(hidden, ffn, rows)
        self.up_proj = QuantLinear(hidden, ffn, rows)
        self.down_proj = QuantLinear(ffn, hidden, cols)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """sqrt-softplus scores; hash layers pick experts by token id, the rest by biased top-k."""

    def __init__(
        self, hidden: int, n_experts: int, top_k: int, vocab: int, hashed: bool, scale: float
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden))
        self.hashed, self.top_k, self.scale = hashed, top_k, scale
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(vocab, top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sqrt(F.softplus(F.linear(x.float(), self.weight.float())))
        if self.hashed:
            if input_ids is None:
                raise ValueError(
                    "hash-routed DeepSeek V4 layers need token ids (prompt embeddings are not supported)"
                )
            indices = self.tid2eid[input_ids].long()
        else:
            biased = scores + self.e_score_correction_bias.float()
            indices = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, indices


class MoE(nn.Module):
    """Router, routed experts and shared expert; the ranks' partial outputs are summed here."""

    def __init__(self, config, layer_idx: int, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        hashed = config.mlp_layer_types[layer_idx] == "hash_moe"
        self.gate = Router(
            config.hidden_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.vocab_size,
            hashed,
            config.routed_scaling_factor,
        )
        self.experts = QuantExperts(
            config.n_routed_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            config.swiglu_limit,
            experts=tp.part(config.n_routed_experts, "the number of routed experts"),
        )
        self.shared_experts = SharedExpert(
            config.hidden_size, config.moe_intermediate_size, config.swiglu_limit, tp
        )
        #: `experts` as an op opaque to torch.compile (`ds4_vllm.model.step_ops`); None: called directly.
        self.routed: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        weights, indices = self.gate(x, input_ids)
        routed = self.routed if self.routed is not None else self.experts
        return self.tp.all_reduce(routed(x, indices, weights) + self.shared_experts(x))
