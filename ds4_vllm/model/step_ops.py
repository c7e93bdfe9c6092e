"""The per-step, data-dependent parts of the model as custom ops, so that the body compiles.

vLLM compiles a model body traced once (``@support_torch_compile``; on the CPU, Dynamo traced
once and Inductor's C++ code). Three parts cannot be in that graph: attention with its cache
writes, compressors and indexer (they read each step's `Ds4CacheMetadata`, whose shapes and
addresses change every step, and the request loop of a prefill; the op takes the query
projection's input and returns the grouped output projection's result, so that a prefill makes
its queries and outputs a block at a time), the routed experts (which
experts run, and on how many tokens, is known only from the router's output), and projections
through packed weights (unpacking reads block indices on the host). Each is one op here, opaque
to the compiler, that finds its layer by name in vLLM's forward context and runs the layer's
eager code, as vLLM's own `unified_attention` and `moe_forward` ops do. Their outputs are
contiguous, as their fake implementations tell the compiler: the compiled code reads them with
those strides (the grouped output projection's einsum returned a permuted tensor, and the
compiled q2 model's log-probs were 0.4 off eager's). The same ops run under ``enforce_eager``,
so both modes compute the same.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import direct_register_custom_op

from ds4_vllm.model.attention import Ds4Attention
from ds4_vllm.model.layers import MoE
from ds4_vllm.model.quant.modules import QuantLinear

_LIBRARY = torch.library.Library("ds4_vllm", "FRAGMENT")  # lives as long as the ops


def _attention(
    q_res: torch.Tensor,
    kv: torch.Tensor,
    y: torch.Tensor,
    positions: torch.Tensor,
    out_features: int,
    layer_name: str,
) -> torch.Tensor:
    context = get_forward_context()
    layer: Ds4Attention = context.no_compile_layers[layer_name]
    q_res, kv, y, positions = _contiguous(q_res, kv, y, positions)
    return layer.attend(q_res, kv, y, positions, step_metadata(context.attn_metadata)).contiguous()


def _attention_fake(
    q_res: torch.Tensor,
    kv: torch.Tensor,
    y: torch.Tensor,
    positions: torch.Tensor,
    out_features: int,
    *_: object,
) -> torch.Tensor:
    return q_res.new_empty(q_res.shape[0], out_features)


def _routed_experts(
    x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, layer_name: str
) -> torch.Tensor:
    layer: MoE = get_forward_context().no_compile_layers[layer_name]
    return layer.experts(*_contiguous(x, indices, weights)).contiguous()


def _routed_experts_fake(x: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(x)


def _packed_linear(x: torch.Tensor, out_features: int, groups: int, layer_name: str) -> torch.Tensor:
    layer: QuantLinear = get_forward_context().no_compile_layers[layer_name]
    return layer.project(x.contiguous(), groups).contiguous()


def _packed_linear_fake(x: torch.Tensor, out_features: int, groups: int, layer_name: str) -> torch.Tensor:
    if groups:
        return x.new_empty(x.shape[0], groups, out_features // groups)
    return x.new_empty(*x.shape[:-1], out_features)


def _contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.contiguous() for t in tensors)


def step_metadata(metadata: object) -> dict | None:
    """This step's metadata by state prefix; None in vLLM's profiling and warm-up runs."""
    if isinstance(metadata, list):  # micro-batched steps are not used by this model
        metadata = metadata[0] if metadata else None
    return metadata or None


direct_register_custom_op("attention", _attention, fake_impl=_attention_fake, target_lib=_LIBRARY)
direct_register_custom_op(
    "routed_experts", _routed_experts, fake_impl=_routed_experts_fake, target_lib=_LIBRARY
)
direct_register_custom_op("packed_linear", _packed_linear, fake_impl=_packed_linear_fake, target_lib=_LIBRARY)


def bind_step_ops(model: nn.Module, vllm_config: VllmConfig) -> None:
    """Route every attention layer and routed-expert set of ``model`` through the ops above,
    registered in vLLM's forward context under their module names."""
    layers = vllm_config.compilation_config.static_forward_context
    for name, module in model.named_modules():
        if isinstance(module, Ds4Attention):
            layers[name] = module
            module.step_attention = _attention_call(name, module.o_a_proj.out_features)
        elif isinstance(module, MoE):
            layers[name] = module
            module.routed = _routed_call(name)


def bind_packed_linears(model: nn.Module, vllm_config: VllmConfig) -> int:
    """Route every projection whose loaded weight is packed through `packed_linear` (after
    loading: only then is it known which are); how many."""
    layers = vllm_config.compilation_config.static_forward_context
    bound = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and module.is_packed:
            layers[name] = module
            module.packed_op = _packed_call(name, module.out_features)
            bound += 1
    return bound


def _packed_call(name: str, out_features: int):
    def call(x, groups):
        return torch.ops.ds4_vllm.packed_linear(x, out_features, groups, name)

    return call


def _attention_call(name: str, out_features: int):
    def call(q_res, kv, y, positions):
        return torch.ops.ds4_vllm.attention(q_res, kv, y, positions, out_features, name)

    return call


def _routed_call(name: str):
    def call(x, indices, weights):
        return torch.ops.ds4_vllm.routed_experts(x, indices, weights, name)

    return call
