"""Cache-free building blocks of DeepSeek V4: norms, hyper-connections and the MoE FFN.

Parameter names mirror transformers' ``DeepseekV4ForCausalLM`` so a checkpoint
written by ``save_pretrained`` loads without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, H] -> (post [T, hc], comb [T, hc, hc], collapsed [T, H])."""
        hc = self.hc
        flat = rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """X'_k = post_k * f(y) + sum_j comb[j, k] * X_j."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """Collapses the streams once more before the final norm and the LM head."""

    def __init__(self, hc: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * hidden))
        self.hc_base = nn.Parameter(torch.zeros(hc))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, ffn: int, limit: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
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


class Experts(nn.Module):
    """Routed experts as stacked tensors; only the experts a batch selects are evaluated.

    One stack per projection, as the checkpoints store them: ``gate_proj`` (w1) and ``up_proj``
    (w3) are [E, ffn, hidden], ``down_proj`` (w2) is [E, hidden, ffn].
    """

    def __init__(self, n_experts: int, hidden: int, ffn: int, limit: float) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.zeros(n_experts, ffn, hidden))
        self.up_proj = nn.Parameter(torch.zeros(n_experts, ffn, hidden))
        self.down_proj = nn.Parameter(torch.zeros(n_experts, hidden, ffn))
        self.n_experts = n_experts
        self.limit = limit

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat_experts = indices.flatten()
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.n_experts).tolist()
        token_of = order // indices.shape[1]
        slot_of = order % indices.shape[1]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            slots = slot_of[start : start + count]
            start += count
            rows = x[tokens]
            gate = F.linear(rows, self.gate_proj[expert]).clamp(max=self.limit)
            up = F.linear(rows, self.up_proj[expert]).clamp(min=-self.limit, max=self.limit)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weights[tokens, slots, None].to(x.dtype)
            out.index_add_(0, tokens, y)
        return out


class MoE(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hashed = config.mlp_layer_types[layer_idx] == "hash_moe"
        self.gate = Router(
            config.hidden_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.vocab_size,
            hashed,
            config.routed_scaling_factor,
        )
        self.experts = Experts(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        )
        self.shared_experts = SharedExpert(
            config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        weights, indices = self.gate(x, input_ids)
        return self.experts(x, indices, weights) + self.shared_experts(x)
