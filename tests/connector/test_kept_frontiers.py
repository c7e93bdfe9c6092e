"""The worker's kept answer-start frontiers: bounded by bytes, taken once, at their own length."""

from __future__ import annotations

import numpy as np

from ds4_vllm.connector.kept_frontiers import KeptFrontier, KeptFrontiers


def frontier(n_tokens: int, rows: int = 4) -> KeptFrontier:
    raw = np.full((rows, 8), n_tokens, dtype=np.float32)
    return KeptFrontier(n_tokens, np.zeros(16, dtype=np.float32), [{"raw": raw}])


def test_take_returns_the_frontier_kept_at_that_length_once() -> None:
    kept = KeptFrontiers()
    assert kept.keep("a", frontier(100))
    assert kept.take("a", 99) is None  # another length: not this state
    assert len(kept) == 0 and kept.nbytes == 0  # released either way
    kept.keep("a", frontier(100))
    got = kept.take("a", 100)
    assert got is not None and got.frontier[0]["raw"][0, 0] == 100
    assert kept.take("a", 100) is None


def test_bytes_are_bounded_and_released() -> None:
    one = frontier(1).nbytes  # 4*8*4 + 16*4 = 192
    kept = KeptFrontiers(max_bytes=2 * one)
    assert kept.keep("a", frontier(1)) and kept.keep("b", frontier(2))
    assert not kept.keep("c", frontier(3))  # over the bound: kept none
    assert kept.nbytes == 2 * one
    kept.keep("a", frontier(4))  # a preempted request keeps again: replaces its own
    assert kept.nbytes == 2 * one and kept.take("a", 4) is not None
    kept.release("b")
    kept.release("unknown")
    assert kept.nbytes == 0 and len(kept) == 0
