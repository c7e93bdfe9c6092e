"""Run the model's modules without a vLLM engine, over `PagedRun`'s paged caches and metadata.

This is enough for the attention paths, at a fraction of an engine's start-up cost.
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


def prefill_hidden(model, token_ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states of one prefill of `token_ids` (caches stay bound for inspection)."""
    from ds4_vllm.model.paged_run import PagedRun

    return PagedRun(model, token_ids.shape[0], 1, "cpu").hidden([token_ids.tolist()], [0])


def decode_metadata(module: nn.Module, prompt_lengths: list[int], device: str = "cpu") -> dict:
    """Zeroed caches on `device` for requests with `prompt_lengths` tokens each, and the metadata
    of one decode step of all of them, as vLLM's runner passes it (`PagedRun.metadata`)."""
    from ds4_vllm.model.paged_run import PagedRun

    run = PagedRun(module, max(prompt_lengths) + 1, len(prompt_lengths), device)
    run.seq_lens = list(prompt_lengths)
    return run.metadata([1] * len(prompt_lengths), list(range(len(prompt_lengths))))
