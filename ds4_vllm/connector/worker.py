"""Worker side of ds4disk: copies rows between vLLM's paged caches and KVC checkpoints.

Loads run before the forward that needs them; each is verified (`CheckpointWriter.open_verified`)
or, for a checkpoint still waiting for the disk, served from the copy in memory. Saves copy the
rows out of the cache inside the step (after the forward, or, for finished requests, from blocks
the connector holds) and hand the copies to a background writer through a queue bounded by bytes,
so serialisation and disk I/O never stall the engine loop unless the disk falls behind by more
than the bound (then the step waits: back-pressure). Every save ends in exactly one
`WriteReport` to the scheduler half, which owns all policy decisions.

Under tensor parallelism every rank holds the same KV rows (`model.parallel`): every rank loads
each checkpoint into its own cache, and only the first rank writes files (one file per
checkpoint, whatever the parallel size). All ranks still take part in a save up to its logits,
which need every rank's share of the vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from ds4_vllm.connector.kept_frontiers import KeptFrontier, KeptFrontiers
from ds4_vllm.connector.metadata import (
    BlockIds,
    Ds4DiskMetadata,
    Ds4DiskWorkerMetadata,
    KeepAnswerStart,
    LoadJob,
    SaveJob,
)
from ds4_vllm.contracts import STEP_HIDDEN_KEY
from ds4_vllm.kvc import LayerArrays, PayloadData, PayloadHeader, SaveReason
from ds4_vllm.model.kv_layout import Ds4KVLayout, StateUnavailable
from ds4_vllm.store import (
    CheckpointWriter,
    LoadFailure,
    LoadReport,
    StoreOptions,
    StoreStats,
    WriteQueue,
    WriteReport,
    tokens_digest,
)
from ds4_vllm.store.fs import open_fs

if TYPE_CHECKING:
    from ds4_vllm.model.model import StepHidden

logger = logging.getLogger(__name__)

#: How long a step waits for the writer to make room before a save is dropped (counted, logged).
WRITE_QUEUE_WAIT_S = 60.0
#: How long a flush (shutdown save) or the final drain waits for the disk.
FLUSH_TIMEOUT_S = 60.0
#: Test hook: seconds each background write sleeps first, to simulate a slow disk.
WRITE_DELAY_ENV = "DS4_VLLM_TEST_WRITE_DELAY_S"


class Ds4DiskWorker:
    def __init__(
        self,
        options: StoreOptions,
        layout: Ds4KVLayout,
        ctx_size: int,
        quant_bits: int,
        *,
        writes_files: bool = True,
    ) -> None:
        self.options = options
        self.writes_files = writes_files  # False on tensor-parallel ranks other than the first
        self.layout = layout
        self.ctx_size = ctx_size
        self.quant_bits = quant_bits
        self.writer = CheckpointWriter(open_fs(options.directory), layout.dims)
        self.queue = WriteQueue(options.write_queue_bytes, WRITE_QUEUE_WAIT_S)
        self.write_delay_s = float(os.environ.get(WRITE_DELAY_ENV, "0") or 0)
        self.stats = StoreStats()  # this side's counters: loads, drops, waits
        self.caches: dict[str, torch.Tensor] = {}
        self.previous_step: StepHidden | None = None  # the last forward's (finished requests ran in it)
        self.kept = KeptFrontiers()
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self._lock = threading.Lock()  # guards the reports the writer thread adds
        self._write_reports: list[WriteReport] = []
        self._load_reports: dict[str, LoadReport] = {}
        self.thread = threading.Thread(target=self._write_loop, name="ds4disk-writer", daemon=True)
        self.thread.start()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.layout.cache_names() if name not in kv_caches]
        if missing:
            raise ValueError(
                f"ds4disk: the model has no KV cache layer {missing[0]!r}; is it Ds4ForCausalLM?"
            )
        self.caches = kv_caches

    # ------------------------------------------------------------------ before the forward

    def start_load_kv(self, meta: Ds4DiskMetadata) -> None:
        for req_id in meta.release_kept:
            self.kept.release(req_id)
        # Finished requests first: a load in this same step may want the state they hold.
        for save in meta.saves:
            if save.after_finish:
                self._save(save, self.previous_step)
                self.finished_sending.add(save.req_id)
        for load in meta.loads:
            self._load(load)

    def _load(self, job: LoadJob) -> None:
        started = time.perf_counter()
        outcome = job.outcome
        n_tokens = outcome.entry_tokens
        source = "memory"
        try:
            copied = self.queue.find(outcome.sha1) if outcome.sha1 is not None else None
            if copied is not None:
                save, _, layers = copied
                if tokens_digest(save.tokens[: outcome.agreed_tokens]) != outcome.tokens_digest:
                    raise LoadFailure(str(outcome.path), "in-flight checkpoint differs from the lookup")
                self.layout.restore(self.caches, job.block_ids, layers, n_tokens, start=job.start)
            else:
                source = "file"
                with self.writer.open_verified(outcome) as checkpoint:
                    self.layout.restore(
                        self.caches, job.block_ids, checkpoint.payload.layers, n_tokens, start=job.start
                    )
        except LoadFailure as exc:
            reason = exc.reason
            if outcome.in_flight and "removed" in reason:
                reason = "its write did not reach the disk (dropped or failed; see the store lines above)"
            self._load_failed(job, reason, corrupt=exc.corrupt)
        except Exception as exc:  # any other failure means: recompute these tokens
            self._load_failed(job, f"{type(exc).__name__}: {exc}")
        else:
            seconds = time.perf_counter() - started
            self.finished_recving.add(job.req_id)
            with self._lock:  # the scheduler's store counts the time (slowest rank) and logs the hit
                self._load_reports[job.req_id] = LoadReport(str(outcome.path), True, seconds=seconds)
            logger.info(
                "kv cache loaded tokens=%d from=%s file=%s load=%.1f ms",
                n_tokens,
                source,
                outcome.path,
                seconds * 1000,
            )

    def _load_failed(self, job: LoadJob, reason: str, *, corrupt: bool = False) -> None:
        logger.warning(
            "kv cache load refused file=%s tokens=%d: %s", job.outcome.path, job.outcome.entry_tokens, reason
        )
        self.failed_recving.add(job.req_id)
        self.finished_recving.add(job.req_id)
        with self._lock:
            self._load_reports[job.req_id] = LoadReport(str(job.outcome.path), False, reason, corrupt)

    # ------------------------------------------------------------------ after the forward

    def wait_for_save(self, meta: Ds4DiskMetadata | None) -> None:
        step = None
        if is_forward_context_available():
            step = get_forward_context().additional_kwargs.get(STEP_HIDDEN_KEY)
        if meta is not None:
            for job in meta.saves:
                if not job.after_finish:
                    self._save(job, step)
            for keep in meta.keep:
                self._keep(keep, step)
            if any(job.flush for job in meta.saves) and not self.queue.drain(FLUSH_TIMEOUT_S):
                logger.warning("kv cache flush timed out after %.0f s", FLUSH_TIMEOUT_S)
        if step is not None:
            self.previous_step = step

    def _keep(self, job: KeepAnswerStart, step: StepHidden | None) -> None:
        """Copy the frontier after the job's tokens to host memory (`KeptFrontiers`)."""
        logits = self._logits(step, job.block_ids, job.n_tokens)
        if not self.writes_files or logits is None:
            return
        try:
            frontier = self.layout.extract_frontier(self.caches, job.block_ids, job.n_tokens)
        except StateUnavailable:
            return
        self.kept.keep(job.req_id, KeptFrontier(job.n_tokens, _host_floats(logits), frontier))

    def _logits(self, step: StepHidden | None, block_ids: BlockIds, n_tokens: int) -> torch.Tensor | None:
        group = self.layout.layers[0].raw.group
        return None if step is None else step.logits_at(block_ids[group], n_tokens - 1)

    def _save(self, job: SaveJob, step: StepHidden | None) -> None:
        """Copy the state after the job's tokens out of the cache now; write it in the background."""
        n_tokens = job.ticket.n_tokens
        logits = None if job.from_kept else self._logits(step, job.block_ids, n_tokens)
        if not self.writes_files:  # the writing rank reports this save, whatever happens to it
            return
        frontier = None
        if job.from_kept:
            kept = self.kept.take(job.req_id, n_tokens)
            if kept is None:
                self._not_saved(job, "no frontier kept where the answer starts")
                return
            host_logits, frontier = kept.logits, kept.frontier
        elif logits is None:
            self._not_saved(job, "no logits for the last token")
            return
        else:
            host_logits = _host_floats(logits)
        try:
            layers = self.layout.extract(self.caches, job.block_ids, n_tokens, frontier)
        except StateUnavailable as exc:
            self._not_saved(job, str(exc))
            return
        nbytes = host_logits.nbytes + _nbytes(layers)
        accepted, waited = self.queue.put(job.ticket.sha1, nbytes, (job, host_logits, layers))
        self.stats.save_wait_seconds += waited
        if waited > 1.0:
            logger.info("kv cache writer behind: step waited %.1f s for queue room", waited)
        if not accepted:
            self.stats.saves_dropped += 1
            self._not_saved(job, f"writer queue full for {waited:.0f} s (--kv-write-queue-mb)", warn=True)

    def _not_saved(self, job: SaveJob, why: str, *, warn: bool = False) -> None:
        reason = SaveReason(job.header.reason).label
        (logger.warning if warn else logger.info)(
            "kv cache skipped tokens=%d reason=%s: %s", job.ticket.n_tokens, reason, why
        )
        with self._lock:
            self._write_reports.append(WriteReport(job.ticket.sha1, job.ticket.path, False, why))

    def _write_loop(self) -> None:
        while True:
            taken = self.queue.take()
            if taken is None:
                return
            sha1, (job, logits, layers) = taken
            try:
                if self.write_delay_s:
                    time.sleep(self.write_delay_s)
                report = self._write(job, logits, layers)
            except Exception as exc:  # a failed save must never take the engine down
                logger.exception("kv cache store failed tokens=%d", job.ticket.n_tokens)
                report = WriteReport(sha1, job.ticket.path, False, f"{type(exc).__name__}: {exc}")
            with self._lock:
                self._write_reports.append(report)
            self.queue.done(sha1)

    def _write(self, job: SaveJob, logits: np.ndarray, layers: list[LayerArrays]) -> WriteReport:
        n_tokens = job.ticket.n_tokens
        n_comp, n_index = self.layout.counts(n_tokens)
        payload = PayloadData(
            header=PayloadHeader.build(self.layout.dims, ctx_size=self.ctx_size, n_tokens=n_tokens),
            tokens=np.asarray(job.tokens, dtype=np.uint32),
            logits=logits,
            n_comp=n_comp,
            n_index_comp=n_index,
            layers=layers,
        )
        return self.writer.write(job.ticket, job.text, job.header, payload, job.tool_map)

    # ------------------------------------------------------------------ reporting

    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        results = (self.finished_sending, self.finished_recving, self.failed_recving)
        self.finished_sending, self.finished_recving, self.failed_recving = set(), set(), set()
        return results

    def take_worker_meta(self) -> Ds4DiskWorkerMetadata | None:
        """Writes and loads that ended since the last step, for the scheduler half."""
        with self._lock:
            writes, loads = self._write_reports, self._load_reports
            self._write_reports, self._load_reports = [], {}
        return Ds4DiskWorkerMetadata(writes, loads) if writes or loads else None

    def shutdown(self) -> None:
        """Drain the writer so every copied checkpoint reaches the disk before the process exits."""
        if not self.thread.is_alive():
            return
        if not self.queue.drain(FLUSH_TIMEOUT_S):
            logger.warning(
                "kv cache writer did not finish within %.0f s; unwritten saves are lost", FLUSH_TIMEOUT_S
            )
        self.queue.close()
        self.thread.join(timeout=5)


def _host_floats(logits: torch.Tensor) -> np.ndarray:
    """Next-token logits as the payload stores them: float32 on the host."""
    return logits.cpu().numpy().astype(np.float32)


def _nbytes(layers: list[LayerArrays]) -> int:
    """Memory held by one checkpoint's copied layer arrays."""
    total = 0
    for layer in layers:
        for f in dataclasses.fields(layer):
            array = getattr(layer, f.name)
            total += 0 if array is None else array.nbytes
    return total
