"""Fixtures shared across the suite: the ds4 engine's recording and the transformers reference."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# vLLM compiles the model body at every engine or server start unless told not to (a minute
# here per start); engines and servers started by tests run it eager (`enforce_eager`'s path:
# vLLM reads this variable as `-cc.mode=none`), except tests/model/test_compiled.py, which
# shows that compiled and eager answer alike.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


@pytest.fixture(scope="session")
def manifest() -> dict:
    """The ds4 engine's recorded requests, answers and files (`../shared/testdata/ds4-engine`)."""
    from tests.shared_data import engine_manifest

    return engine_manifest()


@pytest.fixture(scope="session")
def reference_model():
    """transformers' DeepseekV4ForCausalLM on the default model's weights (the independent reference)."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    from ds4_vllm.model.config import Ds4Config, to_transformers_config
    from ds4_vllm.model.default_model import default_model_dir

    path = default_model_dir()
    config = to_transformers_config(Ds4Config.from_pretrained(path))
    return DeepseekV4ForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
