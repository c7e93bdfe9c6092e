"""Helpers for tests that run the model in real vLLM engines (kept out of conftest so tests can import them).

Engines are expensive on 2 cores (~20 s to start, ~2 GB each), so each test
module owns at most one, module-scoped, and shuts it down before the next.
"""

from __future__ import annotations

import gc

import torch

REFERENCE_TOLERANCE = 1e-3  # log-probability, float32 (issue 2)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Token-id prompts over ordinary vocabulary (no special tokens), deterministic."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 100000, (n,), generator=g).tolist() for n in lengths]


def ds4disk_config(disk_dir, **extra) -> dict:
    """`kv_transfer_config` for the ds4disk connector, as a user of `LLM(...)` writes it."""
    return {
        "kv_connector": "ds4disk",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_disk_dir": str(disk_dir), **extra},
    }


def make_engine(**overrides):
    from vllm import LLM

    kwargs = dict(
        model="ds4",
        dtype="float32",
        enforce_eager=True,
        max_model_len=8192,
        max_num_batched_tokens=4096,
        kv_cache_memory_bytes=2 << 30,
        seed=0,
    )
    kwargs.update(overrides)
    return LLM(**kwargs)


def shutdown_engine(llm) -> None:
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def greedy(max_tokens: int, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, **kw)


def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """Log-probabilities at every position of one full forward over ``tokens``."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
