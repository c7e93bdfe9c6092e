"""Fixtures shared by the model tests."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def reference_model():
    """transformers' DeepseekV4ForCausalLM on the default model's weights (the independent reference)."""
    from transformers import DeepseekV4ForCausalLM

    from ds4_vllm.model.config import Ds4Config, to_transformers_config
    from ds4_vllm.model.default_model import default_model_dir

    path = default_model_dir()
    config = to_transformers_config(Ds4Config.from_pretrained(path))
    return DeepseekV4ForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
