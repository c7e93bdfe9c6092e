"""DeepSeek V4 (Flash) in portable PyTorch: the decoder stack, without vLLM.

The residual is a stack of ``hc_mult`` hyper-connection streams per token; every decoder layer
collapses it for attention and for the MoE FFN and expands it back. Per-sequence state lives in
paged caches (``paged_state.py``) addressed by each step's `Ds4CacheMetadata`. Nothing here
imports vLLM: ``model.py`` wraps this stack as vLLM's ``Ds4ForCausalLM``, and tests or the GPU
check (``scripts/gpu_check.py``) drive it directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ds4_vllm.model.attention import Ds4Attention
from ds4_vllm.model.layers import HyperConnection, HyperHead, MoE, RMSNorm, ShardedEmbedding
from ds4_vllm.model.paged_state import PagedState
from ds4_vllm.model.parallel import SINGLE, Split, TpGroup
from ds4_vllm.model.quant.modules import QuantLinear
from ds4_vllm.model.weight_loader import CheckpointLoader


def build_model(config, dtype: torch.dtype, device: str | torch.device = "cpu", **kwargs) -> Ds4CausalLM:
    """A `Ds4CausalLM` built as vLLM builds one: on ``device``, with torch's default dtype set to
    ``dtype``, so that its parameters (norms, embedding, hyper-connections) are in the model's
    dtype too. Built with a float32 default, a bf16 model keeps float32 residual streams and casts
    every bf16 weight up on every step (its decode step took 2.6x as long)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Ds4CausalLM(config, dtype, **kwargs)
    finally:
        torch.set_default_dtype(previous)


class Ds4DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_idx: int,
        prefix: str,
        dtype,
        tp: TpGroup = SINGLE,
        states: type[PagedState] = PagedState,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        hc = (config.hc_mult, config.hidden_size, config.hc_sinkhorn_iters, config.hc_eps, eps)
        self.self_attn = Ds4Attention(config, layer_idx, f"{prefix}.self_attn", dtype, tp, states)
        self.mlp = MoE(config, layer_idx, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, streams, positions, input_ids, metadata) -> torch.Tensor:
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(collapsed), positions, metadata)
        streams = self.attn_hc.expand(streams, out, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return self.ffn_hc.expand(streams, out, post, comb)


class Ds4Model(nn.Module):
    """The embedding, the decoder layers and the final collapse, norm: hidden states per token.

    ``metadata`` maps each state's prefix to its `Ds4CacheMetadata` for the step (None: a profiling
    run with no caches bound). ``states`` is the class of the per-layer paged states: the plain
    `PagedState` without vLLM, vLLM's `Ds4CacheLayer` in the plugin.
    """

    def __init__(
        self,
        config,
        prefix: str,
        dtype,
        tp: TpGroup = SINGLE,
        states: type[PagedState] = PagedState,
    ) -> None:
        super().__init__()
        self.hc_mult = config.hc_mult
        self.embed_tokens = ShardedEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            Ds4DecoderLayer(config, i, f"{prefix}.layers.{i}", dtype, tp, states)
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


class Ds4CausalLM(nn.Module):
    """The decoder stack and the LM head, with checkpoint loading: the whole model without vLLM.

    ``config`` is a `Ds4Config`; under tensor parallelism ``tp`` names this rank's part (heads,
    output groups, experts, vocabulary rows); ``states`` as for `Ds4Model`; ``body`` builds the
    `Ds4Model` (vLLM's plugin builds a subclass vLLM compiles).
    """

    def __init__(
        self,
        config,
        dtype: torch.dtype,
        tp: TpGroup = SINGLE,
        states: type[PagedState] = PagedState,
        prefix: str = "model",
        body: Callable[..., Ds4Model] = Ds4Model,
    ) -> None:
        super().__init__()
        self.config, self.dtype, self.tp = config, dtype, tp
        self.model = body(config, prefix, dtype, tp, states)
        vocab_rows = tp.part(config.vocab_size, "the vocabulary size")
        self.lm_head = QuantLinear(
            config.hidden_size,
            config.vocab_size,
            Split(0, vocab_rows, config.vocab_size) if tp.size > 1 else None,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary on every rank (each rank computes its rows)."""
        return self.tp.all_gather_last(self.lm_head(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a checkpoint in any DeepSeek V4 naming scheme (see `weight_names`).

        Errors name the checkpoint tensor; `mtp.*` tensors are skipped with one log line.
        """
        return CheckpointLoader(self, self.dtype).load(weights)
