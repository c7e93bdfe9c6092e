"""What the two connector halves send each other every step (pickled across processes).

Scheduler -> worker: `Ds4DiskMetadata` (loads to run before the forward, saves to copy out).
Worker -> scheduler: `Ds4DiskWorkerMetadata` (how writes and loads ended), which vLLM merges
across workers with `aggregate` and hands to the scheduler half in `update_connector_output`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ds4_vllm.kvc import KvcHeader, ToolMapEntry
from ds4_vllm.store import LoadReport, LookupOutcome, WriteReport, WriteTicket

BlockIds = tuple[list[int], ...]  # one list of block ids per KV cache group


@dataclass
class LoadJob:
    """Restore the state `outcome` chose before the forward.

    Positions below `start` are already in vLLM's memory (a local prefix-cache hit) and
    are left untouched. The worker serves an in-flight checkpoint from its copy in memory.
    """

    req_id: str
    outcome: LookupOutcome
    start: int
    block_ids: BlockIds


@dataclass
class SaveJob:
    """Checkpoint the state after `ticket.n_tokens` tokens of one request.

    `after_finish` jobs save a finished request from blocks the connector holds; the
    worker reports `req_id` as finished sending once it has copied them, which releases
    the blocks. `flush` jobs (shutdown saves) are written before the step returns.
    """

    req_id: str
    ticket: WriteTicket
    header: KvcHeader
    text: bytes
    tokens: list[int]
    block_ids: BlockIds
    after_finish: bool = False
    flush: bool = False
    #: Save from the frontier the worker kept at this length (`KeepAnswerStart`), not the cache's.
    from_kept: bool = False
    #: The KTM trailer: tool-call ids whose exact DSML block is in `text` (exact replay).
    tool_map: list[ToolMapEntry] = field(default_factory=list)


@dataclass
class KeepAnswerStart:
    """Copy the frontier and next-token logits after `n_tokens` tokens (where the request's answer
    starts) to host memory after the forward, in case its answer will not come back as generated:
    the request's finish then saves that state (`SaveJob.from_kept`). Released by
    `Ds4DiskMetadata.release_kept` or that save."""

    req_id: str
    n_tokens: int
    block_ids: BlockIds


@dataclass
class Ds4DiskMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    keep: list[KeepAnswerStart] = field(default_factory=list)
    release_kept: list[str] = field(default_factory=list)  # request ids


@dataclass
class Ds4DiskWorkerMetadata(KVConnectorWorkerMetadata):
    writes: list[WriteReport] = field(default_factory=list)
    loads: dict[str, LoadReport] = field(default_factory=dict)  # by request id

    def aggregate(self, other: KVConnectorWorkerMetadata) -> Ds4DiskWorkerMetadata:
        if isinstance(other, Ds4DiskWorkerMetadata):
            self.writes.extend(other.writes)
            for req_id, report in other.loads.items():
                mine = self.loads.get(req_id)
                if mine is None or (mine.ok and not report.ok):  # one failed rank fails the load
                    self.loads[req_id] = report
                elif mine.ok and report.ok and report.seconds > mine.seconds:  # the slowest rank's time
                    self.loads[req_id] = report
        return self
