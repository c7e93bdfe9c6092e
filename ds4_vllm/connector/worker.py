"""Worker side of ds4disk: copies rows between vLLM's paged caches and KVC files.

Loads run before the forward that needs them (sync loads). Saves copy the rows
out of the cache inside the step (after the forward, or, for finished requests,
from blocks the connector holds) and hand the copies to a background writer, so
serialisation and disk I/O never stall the engine loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np
import torch
from vllm.forward_context import get_forward_context

from ds4_vllm.connector.metadata import Ds4DiskMetadata, LoadJob, SaveJob
from ds4_vllm.kvc import KvcHeader, PayloadData, PayloadHeader, SaveReason
from ds4_vllm.model.kv_layout import Ds4KVLayout, StateUnavailable
from ds4_vllm.store import CheckpointStore, StoreOptions

logger = logging.getLogger(__name__)

WRITE_QUEUE_DEPTH = 4  # checkpoints copied out and waiting for the disk; beyond it saves are dropped
WRITE_QUEUE_WAIT_S = 0.5


class Ds4DiskWorker:
    def __init__(self, options: StoreOptions, layout: Ds4KVLayout, ctx_size: int, quant_bits: int) -> None:
        self.options = options
        self.layout = layout
        self.ctx_size = ctx_size
        self.quant_bits = quant_bits
        self.store = CheckpointStore(options, model_dims=layout.dims).open()
        self.caches: dict[str, torch.Tensor] = {}
        self.previous_step = None  # the last forward's StepHidden (finished requests ran in it)
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_DEPTH)
        self.writer = threading.Thread(target=self._write_loop, name="ds4disk-writer", daemon=True)
        self.writer.start()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.layout.cache_names() if name not in kv_caches]
        if missing:
            raise ValueError(
                f"ds4disk: the model has no KV cache layer {missing[0]!r}; is it Ds4ForCausalLM?"
            )
        self.caches = kv_caches

    # ------------------------------------------------------------------ before the forward

    def start_load_kv(self, meta: Ds4DiskMetadata) -> None:
        for job in meta.loads:
            self._load(job)
        for job in meta.saves:
            if job.after_finish:
                self._save(job, self.previous_step)
                self.finished_sending.add(job.req_id)

    def _load(self, job: LoadJob) -> None:
        started = time.perf_counter()
        try:
            checkpoint = self.store.fs.open(job.path)
            try:
                payload = checkpoint.payload
                if payload.header.dims != self.layout.dims or payload.header.n_tokens != job.n_tokens:
                    raise ValueError("checkpoint does not match the model or the lookup")
                self.layout.restore(self.caches, job.block_ids, payload.layers, job.n_tokens, start=job.start)
            finally:
                checkpoint.close()
        except Exception as exc:  # any failure means: recompute these tokens
            logger.warning("kv cache load failed file=%s tokens=%d: %s", job.path, job.n_tokens, exc)
            self.failed_recving.add(job.req_id)
            self.finished_recving.add(job.req_id)
            self.store.record_load(time.perf_counter() - started, failed=True)
            return
        self.finished_recving.add(job.req_id)
        self.store.record_load(time.perf_counter() - started)
        logger.info(
            "kv cache loaded tokens=%d file=%s load=%.1f ms",
            job.n_tokens,
            job.path,
            (time.perf_counter() - started) * 1000,
        )

    # ------------------------------------------------------------------ after the forward

    def wait_for_save(self, meta: Ds4DiskMetadata | None) -> None:
        step = getattr(_forward_context_or_none(), "ds4_step", None)
        if meta is not None and step is not None:
            for job in meta.saves:
                if not job.after_finish:
                    self._save(job, step)
        if step is not None:
            self.previous_step = step

    def _save(self, job: SaveJob, step) -> None:
        """Copy the state after ``job.n_tokens`` out of the cache now; write it in the background."""
        reason = SaveReason(job.reason).name.lower()
        group = self.layout.layers[0].raw.group
        logits = None if step is None else step.logits_at(job.block_ids[group], job.n_tokens - 1)
        if logits is None:
            logger.info(
                "kv cache skipped tokens=%d reason=%s: no logits for the last token", job.n_tokens, reason
            )
            return
        try:
            layers = self.layout.extract(self.caches, job.block_ids, job.n_tokens)
        except StateUnavailable as exc:
            logger.info("kv cache skipped tokens=%d reason=%s: %s", job.n_tokens, reason, exc)
            return
        item = (job, logits.cpu().numpy().astype(np.float32), layers)
        try:
            self.queue.put(item, timeout=WRITE_QUEUE_WAIT_S)
        except queue.Full:
            logger.warning("kv cache skipped tokens=%d reason=%s: writer queue full", job.n_tokens, reason)

    def _write_loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            job, logits, layers = item
            try:
                self._write(job, logits, layers)
            except Exception:  # a failed save must never take the engine down
                logger.exception("kv cache store failed tokens=%d", job.n_tokens)
            finally:
                self.queue.task_done()

    def _write(self, job: SaveJob, logits: np.ndarray, layers) -> None:
        n_comp, n_index = self.layout.counts(job.n_tokens)
        header = KvcHeader.new(
            quant_bits=self.quant_bits,
            reason=SaveReason(job.reason),
            tokens=job.n_tokens,
            ctx_size=self.ctx_size,
        )
        payload = PayloadData(
            header=PayloadHeader.build(self.layout.dims, ctx_size=self.ctx_size, n_tokens=job.n_tokens),
            tokens=np.asarray(job.tokens, dtype=np.uint32),
            logits=logits,
            n_comp=n_comp,
            n_index_comp=n_index,
            layers=layers,
        )
        self.store.store(job.text, header, payload, conversation_key=job.req_id)

    # ------------------------------------------------------------------ reporting

    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        results = (self.finished_sending, self.finished_recving, self.failed_recving)
        self.finished_sending, self.finished_recving, self.failed_recving = set(), set(), set()
        return results

    def shutdown(self) -> None:
        """Drain the writer so every copied checkpoint reaches the disk before the process exits."""
        if not self.writer.is_alive():
            return
        self.queue.join()
        self.queue.put(None)
        self.writer.join(timeout=60)


def _forward_context_or_none():
    try:
        return get_forward_context()
    except AssertionError:
        return None
