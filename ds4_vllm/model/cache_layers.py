"""The vLLM side of the paged state: each `PagedState` as a vLLM attention layer.

vLLM's hybrid KV cache manager allocates a cache for every `Ds4CacheLayer` from its spec and
addresses it through block tables; `Ds4CacheMetadataBuilder` turns vLLM's per-step metadata into
the plain `Ds4CacheMetadata` the model reads (``paged_state.py``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImplBase,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheSpec, MLAAttentionSpec, SlidingWindowMLASpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from ds4_vllm.model.paged_state import Ds4CacheMetadata, PagedState, StateSpec


class Ds4CacheBackend(AttentionBackend):
    """Backend of every DS4 cache layer: pure-torch metadata, any device, BLHNC layout."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        return "DS4_PAGED_STATE"

    @staticmethod
    def get_impl_cls() -> type[AttentionImplBase]:
        # Cache layers compute nothing through an impl; vLLM only asks for the class.
        return AttentionImplBase

    @staticmethod
    def get_builder_cls() -> type[Ds4CacheMetadataBuilder]:
        return Ds4CacheMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Block-outermost keeps each role in its own group with the block size chosen here.
        return (KVCacheLayout.BLHNC,)


class Ds4CacheMetadataBuilder(AttentionMetadataBuilder[Ds4CacheMetadata]):
    """Decode steps (one token per request) can be replayed from full CUDA graphs: their shapes
    depend only on the padded token count (`BatchPlan`), and padding writes to the null block."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_names: list[str], vllm_config: VllmConfig, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        # vLLM's host bound on the sequence lengths is exact unless drafts are speculated.
        self.host_seq_lens_exact = vllm_config.speculative_config is None
        # Under full decode graphs every decode step gathers rows up to the context length.
        graphs = vllm_config.compilation_config.cudagraph_mode
        self.static_seq_len = (
            vllm_config.model_config.max_model_len
            if graphs is not None and graphs.decode_mode() == CUDAGraphMode.FULL
            else None
        )

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec: KVCacheSpec) -> AttentionCGSupport:
        """None with a KV connector: the ds4disk connector reads each step's hidden states from
        the model's Python forward, which a replayed graph does not run."""
        if vllm_config.kv_transfer_config is not None:
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> Ds4CacheMetadata:
        cam = common_attn_metadata
        return Ds4CacheMetadata(
            block_table=cam.block_table_tensor,
            block_size=self.block_size,
            query_start_loc=cam.query_start_loc_cpu,
            seq_lens=self._host_seq_lens(cam),
            num_reqs=cam.num_reqs,
            query_start_loc_device=cam.query_start_loc,
            num_tokens=cam.num_actual_tokens,
            static_seq_len=self.static_seq_len if cam.max_query_len == 1 else None,
        )

    def _host_seq_lens(self, cam: CommonAttentionMetadata) -> torch.Tensor:
        """The sequence lengths on the host: vLLM's host copy where it is exact, else read back
        from the device (a host sync per group and step)."""
        if self.host_seq_lens_exact and cam.seq_lens_cpu_upper_bound is not None:
            return cam.seq_lens_cpu_upper_bound[: cam.num_reqs].clone()  # vLLM reuses its buffer
        return cam.seq_lens[: cam.num_reqs].cpu()


class Ds4CacheLayer(PagedState, AttentionLayerBase):
    """A `PagedState` that vLLM allocates: registered in vLLM's forward context under its prefix,
    with the KV cache spec of its role."""

    def __init__(self, prefix: str, state: StateSpec) -> None:
        super().__init__(prefix, state)
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate DS4 cache layer name {prefix!r}")
        context[prefix] = self
        self.spec = kv_cache_spec(state)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return Ds4CacheBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return self.spec


def kv_cache_spec(state: StateSpec) -> KVCacheSpec:
    """vLLM's spec of a role: sliding-window rows, or compressed rows of ``tokens_per_row`` tokens."""
    if state.window:
        return SlidingWindowMLASpec(
            block_size=state.block_size,
            num_kv_heads=1,
            head_size=state.head_size,
            dtype=state.dtype,
            sliding_window=state.window,
        )
    return MLAAttentionSpec(
        block_size=state.block_size,
        num_kv_heads=1,
        head_size=state.head_size,
        dtype=state.dtype,
        tokens_per_state=state.tokens_per_row,
    )
