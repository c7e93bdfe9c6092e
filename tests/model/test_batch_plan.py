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


def test_padding_tokens_get_the_null_row_and_decode_shapes_can_be_fixed() -> None:
    """vLLM pads a batch for a CUDA graph with requests of no tokens and tokens after the last
    request's: those tokens must address the null block (a row of block 0 after the requests'),
    from the host copy and from the device copy of the query starts alike."""
    starts, seq_lens = [0, 1, 2, 2], [5, 9, 0]  # two requests, one padding request
    on_host = BatchPlan(starts, seq_lens, num_tokens=4)
    on_device = BatchPlan(
        starts, seq_lens, num_tokens=4, query_start_loc_device=torch.tensor(starts, dtype=torch.int32)
    )
    assert on_host.token_req.tolist() == on_device.token_req.tolist() == [0, 1, 3, 3]
    assert on_host.padding_tokens == 2 and on_host.is_decode
    assert on_host.key_len_bound == 9  # eager: the longest request
    assert BatchPlan(starts, seq_lens, static_seq_len=4096).key_len_bound == 4096
    assert not BatchPlan([0, 2, 3], [7, 3]).is_decode
    metadata = Ds4CacheMetadata(
        block_table=torch.tensor([[4, 5], [6, 7], [0, 0]], dtype=torch.int32),
        block_size=64,
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens),
        num_reqs=3,
        num_tokens=4,
    )
    assert metadata.request_blocks.tolist() == [[4, 5], [6, 7], [0, 0], [0, 0]]


def test_the_builder_offers_full_decode_graphs_without_a_connector() -> None:
    """vLLM asks each builder which CUDA graphs it can replay. Uniform decode steps, unless a KV
    connector reads each step's hidden states from the Python forward (ds4disk); under full
    decode graphs decode metadata is sized by the context length."""
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    from ds4_vllm.model.cache_layers import Ds4CacheMetadataBuilder

    spec = SimpleNamespace(block_size=64)

    def config(mode: CUDAGraphMode, connector=None):
        return SimpleNamespace(
            kv_transfer_config=connector,
            speculative_config=None,
            compilation_config=SimpleNamespace(cudagraph_mode=mode),
            model_config=SimpleNamespace(max_model_len=4096),
        )

    plain = config(CUDAGraphMode.FULL_AND_PIECEWISE)
    support = Ds4CacheMetadataBuilder.get_cudagraph_support
    assert support(plain, spec) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert support(config(CUDAGraphMode.FULL_AND_PIECEWISE, object()), spec) == AttentionCGSupport.NEVER
    graphs = Ds4CacheMetadataBuilder(spec, ["a"], plain, "cpu")
    assert graphs.static_seq_len == 4096
    eager = Ds4CacheMetadataBuilder(spec, ["a"], config(CUDAGraphMode.NONE), "cpu")
    assert eager.static_seq_len is None
    piecewise = Ds4CacheMetadataBuilder(spec, ["a"], config(CUDAGraphMode.PIECEWISE), "cpu")
    assert piecewise.static_seq_len is None
