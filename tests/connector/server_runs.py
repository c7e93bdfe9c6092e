"""What the real-server fault tests share: no-cache reference answers and the ds4disk flags."""

from __future__ import annotations

from pathlib import Path

from tests.connector.test_persistence_server import COMMON, answer_ids, complete
from tests.e2e.server_process import ServerProcess


def reference_answers(
    tmp_path: Path, prompts: list[list[int]], tails: list[list[int]], timeout: float
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(first answers, follow-up prompts, their answers) from a server without the connector.

    A follow-up is prompt + the reference's greedy answer + the tail, as an agent's next turn.
    """
    reference = ServerProcess(COMMON, tmp_path / "reference.log").start(timeout=timeout)
    try:
        firsts = [answer_ids(complete(reference, p)) for p in prompts]
        follow_ups = [p + f + t for p, f, t in zip(prompts, firsts, tails, strict=True)]
        expected = [answer_ids(complete(reference, f)) for f in follow_ups]
    finally:
        reference.stop()
    return firsts, follow_ups, expected


def ds4disk_flags(disk_dir: Path, budget_mb: int, kv_memory_bytes: int) -> list[str]:
    """`vllm serve` flags of a ds4disk server with a small disk budget and a small memory cache."""
    return [
        "--kv-connector",
        "ds4disk",
        "--kv-disk-dir",
        str(disk_dir),
        "--kv-disk-space-mb",
        str(budget_mb),
        "--kv-cache-memory-bytes",
        str(kv_memory_bytes),
    ]
