"""The CPU fast path of the hyper-connections' Sinkhorn gives torch's float32 results bit for bit."""

from __future__ import annotations

import pytest
import torch

from ds4_vllm.model.layers import sinkhorn_, sinkhorn_torch_


def reference_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The passes as written in the reference (new tensors each step)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("tokens", [1, 7, 2048])
@pytest.mark.parametrize("n", [4, 3])
def test_sinkhorn_paths_are_bit_identical(tokens: int, n: int) -> None:
    generator = torch.Generator().manual_seed(tokens * 10 + n)
    # Softmax rows of widely spread logits, as the mixes' comb entries are, plus hc_eps.
    comb = torch.softmax(torch.randn(tokens, n, n, generator=generator) * 4, dim=-1) + 1e-6
    expected = reference_sinkhorn(comb, 20, 1e-6)
    fast = sinkhorn_(comb.clone(), 20, 1e-6)
    torch_path = sinkhorn_torch_(comb.clone(), 20, 1e-6)
    assert torch.equal(fast, expected)
    assert torch.equal(torch_path, expected)
    # Columns sum to 1 up to eps and round-off after the final column step (measured max 1.1e-6 here).
    assert (fast.sum(dim=-2) - 1).abs().max() < 1e-5


def test_sinkhorn_works_in_inference_mode() -> None:
    """vLLM runs the model under torch.inference_mode; the numpy view must still be allowed."""
    comb = torch.full((1, 4, 4), 0.25)
    with torch.inference_mode():
        inside = torch.softmax(comb, dim=-1) + 1e-6
        out = sinkhorn_(inside, 20, 1e-6)
    assert torch.equal(out, reference_sinkhorn(torch.softmax(comb, dim=-1) + 1e-6, 20, 1e-6))
