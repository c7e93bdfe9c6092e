"""Issue 25: a decode step off the CPU asks the device for nothing.

The tiny default model and its caches on PyTorch's `meta` device stand in for a GPU: a meta tensor
has no values, so any host read of one (`.tolist()`, `.item()`, `bool(t)`, `nonzero`, a range
check) fails, and a tensor made on the host and mixed into the step fails on the device check.
The step takes the same branches as on a GPU (the CPU-only fast paths test `device.type == "cpu"`).
Only vLLM's host copies of the batch layout (`query_start_loc_cpu`, the sequence lengths) are on
the CPU. `HostSyncCounter` names the call site of anything that would still stall a GPU.
"""

from __future__ import annotations

import pytest
import torch

from ds4_vllm.model.default_model import default_config
from tests.model.direct_model import build_model, decode_metadata
from tests.model.host_syncs import HostSyncCounter

#: Long enough that the ratio-4 layers' indexer picks its top 512 of more than 512 rows.
PROMPT = 2303  # the step's token is at position 2303: it closes a window of 4 and one of 128


@pytest.fixture(scope="module")
def meta_model():
    return build_model(default_config()).to("meta")


def decode_step(model, prompt_lengths: list[int]) -> tuple[torch.Tensor, HostSyncCounter]:
    metadata = decode_metadata(model, prompt_lengths, "meta")
    host = [t for m in metadata.values() for t in (m.query_start_loc, m.seq_lens)]
    ids = torch.zeros(len(prompt_lengths), dtype=torch.int64, device="meta")
    positions = torch.tensor(prompt_lengths, device="meta")
    with torch.no_grad(), HostSyncCounter(host) as counter:
        logits = model.compute_logits(model.model(ids, positions, None, metadata))
    return logits, counter


@pytest.mark.parametrize("batch", [1, 8])
def test_a_decode_step_reads_nothing_back_from_the_device(meta_model, batch: int) -> None:
    lengths = [PROMPT + 4 * 37 * i for i in range(batch)]  # every request closes a window of 4
    logits, counter = decode_step(meta_model, lengths)
    assert logits.device.type == "meta" and tuple(logits.shape) == (batch, 129280)
    # Nothing read back and nothing made from host data, also where tokens close windows of 4
    # and 128 (the first request's closes both): decode steps pool rows on the device.
    assert counter.events == [], counter.counts
