"""Run the model's modules without a vLLM engine: paged caches and metadata built by hand.

One request, its tokens in one step, every cache block distinct (block 0 left unused as vLLM
does). This is enough for the attention paths, at a fraction of an engine's start-up cost.
"""

from __future__ import annotations

import torch
from torch import nn


def build_model(config, dtype: torch.dtype = torch.float32):
    """The model core (`Ds4CausalLM`, no vLLM) for `config` with the default model's weights loaded."""
    from safetensors.torch import load_file

    from ds4_vllm.model.core import Ds4CausalLM
    from ds4_vllm.model.default_model import default_model_dir

    model = Ds4CausalLM(config, dtype)
    model.load_weights(load_file(str(default_model_dir() / "model.safetensors")).items())
    return model.eval()


def bind_caches(module: nn.Module, n_tokens: int, dtype: torch.dtype = torch.float32) -> dict:
    """Zeroed caches for every cache layer under `module`, and the metadata of one prefill step."""
    from ds4_vllm.model.paged_state import Ds4CacheMetadata, PagedState

    metadata = {}
    for layer in module.modules():
        if not isinstance(layer, PagedState):
            continue
        block = layer.state.block_size
        blocks = -(-n_tokens // block) + 1
        layer.kv_cache = torch.zeros(
            blocks, 1, block // layer.tokens_per_row, layer.state.head_size, dtype=dtype
        )
        metadata[layer.prefix] = Ds4CacheMetadata(
            block_table=torch.arange(1, blocks, dtype=torch.int32)[None],
            block_size=block,
            query_start_loc=torch.tensor([0, n_tokens]),
            seq_lens=torch.tensor([n_tokens]),
            num_reqs=1,
        )
    return metadata


def prefill_hidden(model, token_ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states of one prefill of `token_ids` (caches stay bound for inspection)."""
    metadata = bind_caches(model, token_ids.shape[0])
    with torch.no_grad():
        return model.model(token_ids, torch.arange(token_ids.shape[0]), None, metadata)


def decode_metadata(
    module: nn.Module, prompt_lengths: list[int], dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> dict:
    """Caches on `device` for requests with `prompt_lengths` tokens each, and the metadata of one
    decode step (one new token per request, request r's blocks after request r-1's), as vLLM's
    runner passes it: block tables and query starts on the device, their host copies on the CPU."""
    from ds4_vllm.model.paged_state import Ds4CacheMetadata, PagedState

    seq_lens = [n + 1 for n in prompt_lengths]
    metadata = {}
    groups: dict[str, Ds4CacheMetadata] = {}  # vLLM builds one metadata per group of equal specs
    for layer in module.modules():
        if not isinstance(layer, PagedState):
            continue
        block = layer.state.block_size
        width = max(-(-n // block) for n in seq_lens)
        layer.kv_cache = torch.zeros(
            1 + width * len(seq_lens),
            1,
            block // layer.tokens_per_row,
            layer.state.head_size,
            dtype=dtype,
            device=device,
        )
        table = 1 + torch.arange(width * len(seq_lens), dtype=torch.int32).view(len(seq_lens), width)
        metadata[layer.prefix] = groups.get(repr(layer.state)) or Ds4CacheMetadata(
            block_table=table.to(device),
            block_size=block,
            query_start_loc=torch.arange(len(seq_lens) + 1),
            seq_lens=torch.tensor(seq_lens),
            num_reqs=len(seq_lens),
            query_start_loc_device=torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device),
        )
        groups[repr(layer.state)] = metadata[layer.prefix]
    return metadata
