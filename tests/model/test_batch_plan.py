"""The per-step batch plan is built where the step's tensors live (issue 25)."""

from __future__ import annotations

import torch

from ds4_vllm.model.paged_state import BatchPlan, Ds4CacheMetadata


def test_token_requests_are_on_the_block_tables_device() -> None:
    """On CUDA, `plan.token_req` (built on the CPU) indexed GPU rows and the step failed. The
    meta device stands in for CUDA: the plan follows the block table's device."""
    metadata = Ds4CacheMetadata(
        block_table=torch.zeros(2, 4, dtype=torch.int32, device="meta"),
        block_size=256,
        query_start_loc=torch.tensor([0, 2, 5]),
        seq_lens=torch.tensor([7, 3]),
        num_reqs=2,
    )
    plan = metadata.plan
    assert plan.token_req.device.type == "meta" and tuple(plan.token_req.shape) == (5,)
    on_cpu = BatchPlan([0, 2, 5], [7, 3])
    assert on_cpu.token_req.tolist() == [0, 0, 1, 1, 1] and on_cpu.pos_start == [5, 0]


def test_the_builder_takes_the_sequence_lengths_from_vllms_host_copy() -> None:
    """Issue 25: reading `seq_lens` back from the device was a host sync per cache group and step.
    vLLM's host bound is exact without speculative decoding; with it, the device copy is read."""
    from types import SimpleNamespace

    from ds4_vllm.model.cache_layers import Ds4CacheMetadataBuilder

    host = torch.tensor([7, 3, 0])  # vLLM pads its buffer to the padded batch
    on_device = SimpleNamespace(
        num_reqs=2, seq_lens=torch.zeros(3, device="meta"), seq_lens_cpu_upper_bound=host
    )
    exact = SimpleNamespace(host_seq_lens_exact=True)
    assert Ds4CacheMetadataBuilder._host_seq_lens(exact, on_device).tolist() == [7, 3]  # meta: never read
    speculating = SimpleNamespace(host_seq_lens_exact=False)
    drafts = SimpleNamespace(num_reqs=2, seq_lens=torch.tensor([6, 3, 0]), seq_lens_cpu_upper_bound=host)
    assert Ds4CacheMetadataBuilder._host_seq_lens(speculating, drafts).tolist() == [6, 3]
