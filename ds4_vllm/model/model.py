"""``Ds4ForCausalLM``: the decoder stack of ``core.py`` as a vLLM model.

Per-sequence state lives in vLLM's paged KV cache (each state a `cache_layers.Ds4CacheLayer`),
so vLLM's scheduler batches requests, chunks prefills and reuses prefixes. This module reads
vLLM's forward context, leaves the step's hidden states for the ds4disk connector, and loads
checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import torch
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context

from ds4_vllm.contracts import STEP_HIDDEN_KEY
from ds4_vllm.model.cache_layers import Ds4CacheLayer
from ds4_vllm.model.core import Ds4CausalLM
from ds4_vllm.model.cpu_kernels import use_vllm_cpu_kernels
from ds4_vllm.model.paged_state import BatchPlan, Ds4CacheMetadata
from ds4_vllm.model.parallel import TpGroup


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
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        use_vllm_cpu_kernels(self)  # a no-op off the CPU
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
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batched steps are not used by this model
            metadata = metadata[0] if metadata else None
        total = positions.shape[0]
        count = total
        if metadata:
            count = next(iter(metadata.values())).plan.num_tokens
        else:
            metadata = None
        ids = input_ids[:count] if input_ids is not None else None
        embeds = inputs_embeds[:count] if inputs_embeds is not None else None
        hidden = self.model(ids, positions[:count], embeds, metadata)
        if metadata is not None:
            first_raw = metadata[self.model.layers[0].self_attn.swa_cache.prefix]
            step = StepHidden.capture(hidden, first_raw, self.compute_logits)
            get_forward_context().additional_kwargs[STEP_HIDDEN_KEY] = step
        if count < total:  # vLLM may pad the batch; padded rows carry no request
            hidden = torch.cat([hidden, hidden.new_zeros(total - count, hidden.shape[-1])])
        return hidden
