"""Arithmetic cost of DeepSeek V4 (as ``Ds4ForCausalLM`` runs it): FLOPs per token by position.

What the architecture must compute, not what our code happens to do: the yardstick that measured
prefill and decode times are compared against (issue 11). A FLOP is one multiply or one add of a
matrix product or dot product (a multiply-add is 2 FLOPs); norms, RoPE, softmax, Sinkhorn
passes, gating and other elementwise work are left out (a few hundred FLOPs per token and layer).

Per token at position ``p`` (0-based; it sees ``p + 1`` tokens, itself included):

- projections: q_a, q_b, kv, grouped o_a, o_b; on compressed layers the compressor's kv and
  gate projections (two lanes on ratio 4); on ratio-4 layers the indexer's compressor, q_b and
  head weights;
- window attention: ``min(p + 1, window)`` raw rows, q·k and p·v for every head;
- ratio 4: the indexer scores all ``(p + 1) // 4`` visible compressed rows (every indexer head,
  plus the weighted sum over heads), then attention over ``min((p + 1) // 4, index_topk)`` rows;
- ratio 128: attention over all ``(p + 1) // 128`` compressed rows;
- MoE: router scores over every routed expert, ``num_experts_per_tok`` routed plus the shared
  experts (gate, up, down);
- hyper-connections: per sub-layer the ``(2 + hc) * hc`` mixing weights, the collapse and the
  expand (``hc x hc`` stream mixing plus the post-scaled output); once more in the head.

The LM head runs once per request and step, on the step's last token: in a prefill that vLLM
chunks into ``chunk`` tokens per step, once per chunk (vLLM computes, then discards, the logits of
a partial prefill). Chunking changes nothing else: each token sees the same rows either way.
The indexer's term grows with the position, so prefill FLOPs are quadratic in the prompt length
on ratio-4 layers (and, 32x smaller, on ratio-128 layers); everything else is linear.
"""

from __future__ import annotations

from typing import Any

import numpy as np

COMPONENTS = (
    "projections",
    "window_attention",
    "indexer",
    "ratio4_attention",
    "ratio128_attention",
    "moe",
    "hyper_connections",
    "lm_head",
)


def _ratios(config: Any) -> list[int]:
    ratios = getattr(config, "compress_ratios", None)
    if ratios is None:
        raise ValueError("config has no compress_ratios (per-layer compression ratio 0, 4 or 128)")
    return list(ratios)


def flops_by_component(config: Any, positions: np.ndarray | int) -> dict[str, np.ndarray]:
    """FLOPs of the token at each of ``positions`` through all layers, per component (no LM head)."""
    p = np.asarray(positions, dtype=np.int64)
    seen = p + 1
    hidden, heads, head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
    ih, idim = config.index_n_heads, config.index_head_dim
    hc = config.hc_mult
    attend = 4 * heads * head_dim  # q·k and p·v of one row, every head
    out = {name: np.zeros_like(p, dtype=np.float64) for name in COMPONENTS}
    for ratio in _ratios(config):
        proj = 2 * hidden * config.q_lora_rank + 2 * config.q_lora_rank * heads * head_dim
        proj += 2 * hidden * head_dim  # kv
        proj += 2 * heads * head_dim * config.o_lora_rank  # grouped o_a: each group its own slice
        proj += 2 * config.o_groups * config.o_lora_rank * hidden  # o_b
        if ratio:
            lanes = 2 if ratio == 4 else 1
            proj += 2 * (2 * hidden * lanes * head_dim)  # compressor kv + gate
        if ratio == 4:
            proj += 2 * (2 * hidden * 2 * idim)  # indexer compressor kv + gate (two lanes)
            proj += 2 * config.q_lora_rank * ih * idim + 2 * hidden * ih  # indexer q_b, head weights
        out["projections"] += proj
        out["window_attention"] += attend * np.minimum(seen, config.sliding_window)
        if ratio == 4:
            rows = seen // 4
            out["indexer"] += (2 * ih * idim + 2 * ih) * rows
            out["ratio4_attention"] += attend * np.minimum(rows, config.index_topk)
        elif ratio == 128:
            out["ratio128_attention"] += attend * (seen // 128)
        routed = 3 * 2 * hidden * config.moe_intermediate_size
        shared = getattr(config, "n_shared_experts", 1) or 0
        out["moe"] += 2 * hidden * config.n_routed_experts + (config.num_experts_per_tok + shared) * routed
        mixes = 2 * hc * hidden * (2 + hc) * hc
        out["hyper_connections"] += 2 * (mixes + 2 * hc * hidden + 2 * hc * hc * hidden + 2 * hc * hidden)
    out["hyper_connections"] += 2 * hc * hidden * hc + 2 * hc * hidden  # head collapse
    return out


def lm_head_flops(config: Any) -> int:
    """FLOPs of one row of logits."""
    return 2 * config.hidden_size * config.vocab_size


def token_flops(config: Any, position: int) -> float:
    """FLOPs of one decode step at ``position`` (batch 1): every layer plus the LM head."""
    return float(sum(v.sum() for v in flops_by_component(config, position).values())) + lm_head_flops(config)


def prefill_flops_by_component(config: Any, n_tokens: int, chunk: int | None = None) -> dict[str, float]:
    """FLOPs of prefilling ``n_tokens`` in steps of ``chunk`` tokens (None: one step), per component."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if chunk is not None and chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    parts = flops_by_component(config, np.arange(n_tokens))
    totals = {name: float(v.sum()) for name, v in parts.items()}
    steps = 0 if n_tokens == 0 else (1 if chunk is None else -(-n_tokens // chunk))
    totals["lm_head"] = float(steps * lm_head_flops(config))
    return totals


def prefill_flops(config: Any, n_tokens: int, chunk: int | None = None) -> float:
    """Total FLOPs of prefilling ``n_tokens`` (see `prefill_flops_by_component`)."""
    return sum(prefill_flops_by_component(config, n_tokens, chunk).values())
