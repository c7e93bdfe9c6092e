"""Jobs the scheduler side hands to the worker side each step (pickled across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

BlockIds = tuple[list[int], ...]  # one list of block ids per KV cache group


@dataclass
class LoadJob:
    """Scheduler -> worker: restore ``n_tokens`` tokens of state from ``path`` before the forward.

    Positions below ``start`` are already in vLLM's memory (a local prefix-cache hit)
    and are left untouched.
    """

    req_id: str
    path: str
    n_tokens: int
    start: int
    block_ids: BlockIds


@dataclass
class SaveJob:
    """Scheduler -> worker: checkpoint the state after ``n_tokens`` tokens of one request.

    ``after_finish`` jobs save a finished request from blocks the connector holds; the
    worker reports ``req_id`` as finished sending once it has copied them, which
    releases the blocks.
    """

    req_id: str
    n_tokens: int
    reason: int
    text: bytes
    tokens: list[int]
    block_ids: BlockIds
    after_finish: bool = False


@dataclass
class Ds4DiskMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
