"""Issue 25: a decode step can be captured once in a CUDA graph and replayed for any later step.

A replayed graph runs the same kernels on the same buffers with the same shapes; only the values
in the buffers change. On this CPU-only machine that contract is checked directly: the tiny
default's decode step through `StaticDecode`'s fixed buffers (as vLLM's full decode graphs feed
it) is traced op by op, and every step, whichever requests it holds, at whichever positions
(closing a compressor window or not), padded as vLLM pads a batch or full, runs the same ops with
the same shapes, reads nothing back from its tensors and makes none from host data. What it
computes equals an eager step of the same tokens, and padding writes nowhere a request reads.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds4_vllm.model.default_model import default_config
from ds4_vllm.model.paged_run import PagedRun, StaticDecode
from tests.model.direct_model import build_model
from tests.model.host_syncs import HostSyncCounter

#: The first prompt is long enough for the indexer to pick its top 512 of more rows; each decode
#: step below moves every request one token, through positions that close windows of 4 and 128.
PROMPTS = [2303, 700, 127, 64]
BATCH = len(PROMPTS)
CAPACITY = 2560


class OpTrace(TorchDispatchMode):
    """Every aten op of a region with the shapes and dtypes of what it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        shapes = tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))
        self.ops.append((str(func), shapes))
        return out


#: (requests in the step): full, padded with requests of no tokens, a single request.
STEPS = [[0, 1, 2, 3], [0, 2], [1, 2, 3], [3], [0, 1, 2, 3]]


def test_a_replayed_step_asks_the_device_nothing_and_runs_the_same_ops() -> None:
    """On the `meta` device (no values: any host read of a tensor fails or is counted; the GPU's
    branches, not the CPU fast paths), every step through the buffers runs the same op sequence."""
    model = build_model(default_config()).to("meta")
    run = PagedRun(model, CAPACITY, BATCH, "meta", static_seq_len=True)
    run.seq_lens = list(PROMPTS)
    static = StaticDecode(run, BATCH)
    traces = []
    for step, requests in enumerate(STEPS):
        static.load([1000 + step] * len(requests), requests)
        with torch.no_grad(), OpTrace() as trace, HostSyncCounter(device="meta") as syncs:
            logits = static.replay()
        assert syncs.events == [], syncs.counts
        assert logits.device.type == "meta" and tuple(logits.shape) == (BATCH, 129280)
        traces.append(trace.ops)
    assert len(traces[0]) > 1000
    assert all(t == traces[0] for t in traces[1:])


@pytest.fixture(scope="module")
def runs():
    """The same model, requests and prompts twice: one run stepped eagerly, one through buffers."""
    model = build_model(default_config())
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 120_000, (n,), generator=generator).tolist() for n in PROMPTS]
    eager = PagedRun(model, CAPACITY, BATCH, "cpu")
    graphed = PagedRun(model, CAPACITY, BATCH, "cpu", static_seq_len=True)
    for run in (eager, graphed):
        run.step(prompts, list(range(BATCH)))
    return eager, graphed, StaticDecode(graphed, BATCH)


def test_replayed_steps_compute_what_eager_steps_do(runs) -> None:
    """Full and padded batches through the buffers (gathering rows up to the capacity) against
    eager steps of the same tokens (rows up to the longest request), positions closing windows
    of 4 and 128 (request 2 starts at 127) and not."""
    eager, _, static = runs
    diffs = []
    for step, requests in enumerate(STEPS):
        tokens = [1000 + 7 * step + r for r in requests]
        expected = eager.step([[t] for t in tokens], requests)
        diffs.append(float((static.step(tokens, requests) - expected).abs().max()))
    # The same float32 math on differently sized batches and key lists: measured at most 4.2e-6
    # over these steps (logits of magnitude ~10); a stale buffer or a wrong row is off by far more.
    assert max(diffs) < 1e-5, diffs


def test_padding_writes_only_the_null_block(runs) -> None:
    _, graphed, static = runs
    before = {name: cache.clone() for name, cache in graphed.caches.items()}
    static.step([1234], [2])  # one request, three padding requests and tokens
    for key, states in graphed.groups.items():
        owned = set(graphed.tables[key][2].tolist())
        for state in states:
            cache = graphed.caches[state.prefix]
            changed = (cache != before[state.prefix]).flatten(1).any(1).nonzero().flatten().tolist()
            # request 2's blocks (its new rows) and the null block 0 (the padding's), nothing else
            assert set(changed) <= owned | {0}, (state.prefix, changed)
            if state.tokens_per_row == 1:  # a row per token: the new token's is written
                assert set(changed) & owned, state.prefix
