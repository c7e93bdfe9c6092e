"""``Ds4ForCausalLM``: DeepSeek V4 (Flash) for vLLM in portable PyTorch.

The residual is a stack of ``hc_mult`` hyper-connection streams per token; every
decoder layer collapses it for attention and for the MoE FFN and expands it back.
Per-sequence state lives in vLLM's paged KV cache (see ``cache_layers.py``), so
vLLM's scheduler batches requests, chunks prefills and reuses prefixes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context

from ds4_vllm.contracts import STEP_HIDDEN_KEY
from ds4_vllm.model.attention import Ds4Attention
from ds4_vllm.model.cache_layers import BatchPlan, Ds4CacheMetadata
from ds4_vllm.model.layers import HyperConnection, HyperHead, MoE, RMSNorm, ShardedEmbedding
from ds4_vllm.model.parallel import SINGLE, Split, TpGroup
from ds4_vllm.model.quant.modules import QuantLinear
from ds4_vllm.model.weight_loader import CheckpointLoader


class Ds4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, prefix: str, dtype, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        hc = (config.hc_mult, config.hidden_size, config.hc_sinkhorn_iters, config.hc_eps, eps)
        self.self_attn = Ds4Attention(config, layer_idx, f"{prefix}.self_attn", dtype, tp)
        self.mlp = MoE(config, layer_idx, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, streams, positions, input_ids, metadata) -> torch.Tensor:
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(collapsed), positions, metadata)
        streams = HyperConnection.expand(streams, out, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return HyperConnection.expand(streams, out, post, comb)


class Ds4Model(nn.Module):
    def __init__(self, config, prefix: str, dtype, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.hc_mult = config.hc_mult
        self.embed_tokens = ShardedEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            Ds4DecoderLayer(config, i, f"{prefix}.layers.{i}", dtype, tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config.hc_mult, config.hidden_size, config.hc_eps, config.rms_norm_eps)

    def forward(self, input_ids, positions, inputs_embeds, metadata) -> torch.Tensor:
        embeds = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        streams = embeds.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, positions, input_ids, metadata)
        return self.norm(self.hc_head(streams))


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


class Ds4ForCausalLM(nn.Module):
    """vLLM model class registered as ``Ds4ForCausalLM`` (see ``ds4_vllm.register``).

    Under tensor parallelism (vLLM's ``--tensor-parallel-size``) the heads, output groups, experts
    and vocabulary split across ranks; the KV state is the same on every rank (`parallel`).
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        dtype = vllm_config.model_config.dtype
        self.dtype = dtype
        model_prefix = f"{prefix}.model" if prefix else "model"
        self.tp = TpGroup.current()
        self.model = Ds4Model(config, model_prefix, dtype, self.tp)
        vocab_rows = self.tp.part(config.vocab_size, "the vocabulary size")
        self.lm_head = QuantLinear(
            config.hidden_size,
            config.vocab_size,
            Split(0, vocab_rows, config.vocab_size) if self.tp.size > 1 else None,
        )

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

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary on every rank (each rank computes its rows)."""
        return self.tp.all_gather_last(self.lm_head(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a checkpoint in any DeepSeek V4 naming scheme (see `weight_names`).

        Errors name the checkpoint tensor; `mtp.*` tensors are skipped with one log line.
        """
        return CheckpointLoader(self, self.dtype).load(weights)
