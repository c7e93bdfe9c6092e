"""``Ds4ForCausalLM``: the decoder stack of ``core.py`` as a vLLM model.

Per-sequence state lives in vLLM's paged KV cache (each state a `cache_layers.Ds4CacheLayer`),
so vLLM's scheduler batches requests, chunks prefills and reuses prefixes. The decoder body is
compiled by vLLM on the CPU (``@support_torch_compile``) unless ``enforce_eager``; attention, the
routed experts and packed projections run as custom ops outside the graph (`step_ops`). This
module reads vLLM's forward context, leaves the step's hidden states for the ds4disk connector,
and loads checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property, partial

import torch
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.platforms import current_platform

from ds4_vllm.contracts import STEP_HIDDEN_KEY
from ds4_vllm.model.cache_layers import Ds4CacheLayer
from ds4_vllm.model.core import Ds4CausalLM, Ds4Model
from ds4_vllm.model.cpu_kernels import use_vllm_cpu_kernels
from ds4_vllm.model.paged_state import BatchPlan, Ds4CacheMetadata, PagedState
from ds4_vllm.model.parallel import TpGroup
from ds4_vllm.model.step_ops import bind_packed_linears, bind_step_ops, step_metadata


@dataclass
class StepHidden:
    """This step's final hidden states, left on the forward context for the ds4disk connector.

    A checkpoint stores the next-token logits after its last token; the connector computes
    them from these rows, for save points inside a prefill chunk as well as at its end, and
    for finished requests in the step after their last one. Requests are recognised by the
    block ids of the first layer's raw-window cache (copied: vLLM reuses its buffers).
    """

    hidden: torch.Tensor  # [tokens, hidden]
    plan: BatchPlan
    block_table: torch.Tensor  # [requests, width] of the first raw-window cache's group
    block_size: int
    compute_logits: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def capture(cls, hidden: torch.Tensor, meta: Ds4CacheMetadata, compute_logits) -> StepHidden:
        # A copy on the block table's own device: nothing waits for it here; the host reads it
        # only when the connector asks for logits (`logits_at`).
        table = meta.block_table[: meta.num_reqs].clone()
        return cls(hidden, meta.plan, table, meta.block_size, compute_logits)

    @cached_property
    def _host_block_table(self) -> torch.Tensor:
        return self.block_table.cpu()

    def logits_at(self, block_ids: list[int], position: int) -> torch.Tensor | None:
        """float32 logits after the token at ``position`` of the request owning ``block_ids``, if it ran."""
        index = position // self.block_size
        if index >= len(block_ids) or index >= self.block_table.shape[1]:
            return None
        for r, queries, first, seq_len in self.plan.requests():
            if first <= position < seq_len and int(self._host_block_table[r, index]) == block_ids[index]:
                row = self.hidden[queries.start + position - first]
                return self.compute_logits(row[None])[0].float()
        return None


def _compiles_here(vllm_config: VllmConfig) -> bool:
    """Compiled on the CPU with one rank, for now. Elsewhere vLLM would also capture pieces of the
    graph in CUDA graphs, and the attention op (host-side logic per step) must be one of its
    splitting ops first; no GPU has run that yet (`scripts/gpu_check.sh`). Off the CPU the body
    runs eager, with the full decode graphs of `cache_layers`. Under tensor parallelism the
    all-reduces would be in the graph: untested, so eager too."""
    return current_platform.is_cpu() and TpGroup.current().size == 1


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0}, enable_if=_compiles_here
)
class Ds4CompiledBody(Ds4Model):
    """`Ds4Model` as vLLM compiles it: no metadata argument (attention reads it from the forward
    context inside its op, `step_ops`), so the traced graph holds only this step's tensors."""

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        prefix: str,
        config,
        dtype: torch.dtype,
        tp: TpGroup,
        states: type[PagedState],
    ) -> None:
        super().__init__(config, prefix, dtype, tp, states)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return super().forward(input_ids, positions, inputs_embeds, None)


def _compiled_body(vllm_config: VllmConfig, config, prefix: str, dtype, tp, states) -> Ds4CompiledBody:
    return Ds4CompiledBody(
        vllm_config=vllm_config, prefix=prefix, config=config, dtype=dtype, tp=tp, states=states
    )


class Ds4ForCausalLM(Ds4CausalLM):
    """vLLM model class registered as ``Ds4ForCausalLM`` (see ``ds4_vllm.register``).

    Under tensor parallelism (vLLM's ``--tensor-parallel-size``) the heads, output groups, experts
    and vocabulary split across ranks; the KV state is the same on every rank (`parallel`).
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(
            vllm_config.model_config.hf_config,
            vllm_config.model_config.dtype,
            TpGroup.current(),
            states=Ds4CacheLayer,
            prefix=f"{prefix}.model" if prefix else "model",
            body=partial(_compiled_body, vllm_config),
        )
        self.vllm_config = vllm_config
        bind_step_ops(self.model, vllm_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        use_vllm_cpu_kernels(self)  # a no-op off the CPU
        bind_packed_linears(self.model, self.vllm_config)
        return loaded

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        metadata = step_metadata(get_forward_context().attn_metadata)
        total = positions.shape[0]
        count = total if metadata is None else next(iter(metadata.values())).plan.num_tokens
        ids = input_ids[:count] if input_ids is not None else None
        embeds = inputs_embeds[:count] if inputs_embeds is not None else None
        hidden = self.model(ids, positions[:count], embeds)
        if metadata is not None:
            first_raw = metadata[self.model.layers[0].self_attn.swa_cache.prefix]
            step = StepHidden.capture(hidden, first_raw, self.compute_logits)
            get_forward_context().additional_kwargs[STEP_HIDDEN_KEY] = step
        if count < total:  # vLLM may pad the batch; padded rows carry no request
            hidden = torch.cat([hidden, hidden.new_zeros(total - count, hidden.shape[-1])])
        return hidden
