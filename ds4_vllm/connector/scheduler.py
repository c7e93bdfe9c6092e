"""Scheduler side of ds4disk: disk lookups, load jobs and save points, in the engine core.

Everything here is decided from token ids and byte text; the worker side moves
the tensors. This half owns the directory's store (`CheckpointStore`): lookups, pins,
the budget, eviction and nested copies are decided in this one process, and the worker
reports back how each write and load ended (`Ds4DiskWorkerMetadata`). vLLM may call
``get_num_new_matched_tokens`` several times for one request, so it only looks (and
remembers the answer); files are touched when a load is actually scheduled.

A lookup also sees checkpoints handed to the writer but not yet on disk, so a turn that
follows its predecessor quickly still loads the state that turn just saved (the worker
serves it from memory). On SIGTERM (vLLM's graceful `--shutdown-timeout` drain) the state
of every request in the next step is saved with reason `shutdown`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput

from ds4_vllm.connector.metadata import (
    BlockIds,
    Ds4DiskMetadata,
    Ds4DiskWorkerMetadata,
    KeepAnswerStart,
    LoadJob,
    SaveJob,
)
from ds4_vllm.connector.token_text import TokenText
from ds4_vllm.connector.tool_map import RequestToolMap
from ds4_vllm.contracts import ASSISTANT, DISK_TOKENS_PARAM, THINK_END, THINK_START, USER
from ds4_vllm.kvc import KvcHeader, PayloadHeader, SaveReason, ToolMapEntry, payload_size
from ds4_vllm.model.config import routed_expert_quant_bits
from ds4_vllm.model.kv_layout import Ds4KVLayout
from ds4_vllm.store import (
    AnswerEnd,
    CacheDecision,
    CheckpointStore,
    LoadReport,
    LookupOutcome,
    SaveDecision,
    StoreOptions,
    TraceWriter,
    answer_comes_back,
    answer_start,
    answer_start_save,
    finished_save,
    plan_prefill_saves,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """What the scheduler side tracks for one live request."""

    request: Any  # vllm.v1.request.Request (its all_token_ids grow as it decodes)
    planned: list[SaveDecision] = field(default_factory=list)
    last_stored: int = 0
    saved: set[int] = field(default_factory=set)  # lengths a checkpoint of this request holds
    answer_start: int = 0  # where its answer starts (`store.answer_start`); 0 before planning
    kept: bool = False  # the worker keeps the frontier at `answer_start` (`KeepAnswerStart`)
    traced: bool = False
    decision: CacheDecision | None = None
    tool_map: RequestToolMap | None = None  # built at the first save
    disk_tokens: int = 0  # prompt tokens vLLM takes from a disk load (its "external" tokens)


@dataclass
class PendingLoad:
    outcome: LookupOutcome
    start: int  # tokens vLLM already had in memory
    scheduled: bool = False  # blocks are allocated; the load goes out in the next metadata


class Ds4DiskScheduler:
    def __init__(
        self, vllm_config: VllmConfig, options: StoreOptions, layout: Ds4KVLayout, model_fingerprint: str
    ) -> None:
        model_config = vllm_config.model_config
        self.options = options
        self.layout = layout
        self.ctx_size = model_config.max_model_len
        self.tensor_parallel_size = vllm_config.parallel_config.tensor_parallel_size
        self.quant_bits = routed_expert_quant_bits(model_config.hf_config)
        self.token_text = TokenText.from_tokenizer_dir(model_config.tokenizer)
        self.user_id = self.token_text.token_id(USER) or -1
        self.assistant_id = self.token_text.token_id(ASSISTANT) or -1
        self.think_start_id = self.token_text.token_id(THINK_START) or -1
        self.think_end_id = self.token_text.token_id(THINK_END) or -1
        self.store = CheckpointStore(
            options, model_dims=layout.dims, model_fingerprint=model_fingerprint
        ).open()
        self.shutdown_requested = False
        self.shutdown_saved = False
        _chain_shutdown_signal(self._on_shutdown_signal)
        self.trace = TraceWriter(options.trace) if options.trace else None
        self.kv_cache_manager: KVCacheManager | None = None
        self.requests: dict[str, RequestState] = {}
        self.lookups: dict[str, tuple[int, LookupOutcome | None]] = {}
        self.pending_loads: dict[str, PendingLoad] = {}
        self.loading: dict[str, LookupOutcome] = {}  # load jobs sent, result not yet back
        self.finished_saves: list[SaveJob] = []
        self.release_kept: list[str] = []

    # ------------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        state = self.requests.setdefault(req_id, RequestState(request))
        prompt = request.prompt_token_ids or []
        outcome = self._lookup(req_id, prompt)
        state.decision = CacheDecision(
            prompt_tokens=len(prompt),
            prompt_bytes=self.lookups[req_id][0],
            vllm_cached_tokens=num_computed_tokens,
            disk_miss_reason=None if outcome is None or outcome.hit else outcome.reason,
        )
        if outcome is None or not outcome.hit:
            return 0, False
        if outcome.agreed_tokens < outcome.entry_tokens:
            # The state cannot be rewound: a partial token agreement is a miss.
            state.decision = _with(state.decision, disk_miss_reason=outcome.reason)
            return 0, False
        # vLLM must compute at least one token; a full-prompt checkpoint is restored whole and
        # its last token recomputed, which rewrites the same per-token slots.
        loadable = min(outcome.entry_tokens, len(prompt) - 1)
        if loadable <= num_computed_tokens:
            state.decision = _with(state.decision, disk_miss_reason="vLLM memory already holds as much")
            return 0, False
        if outcome.in_flight and self.tensor_parallel_size > 1:
            # Only the first rank holds the copy of a write in flight; the others read the file.
            # Ask again next step (vLLM keeps the request waiting), once the write has landed.
            del self.lookups[req_id]
            return None, False
        self.pending_loads[req_id] = PendingLoad(outcome, num_computed_tokens)
        # Asynchronous: the request waits until the worker reports the load done or failed;
        # a failure then resets it to a full recompute (vLLM's "recompute" policy), which is
        # the only failure path vLLM offers for models with several KV cache groups.
        return loadable - num_computed_tokens, True

    def _lookup(self, req_id: str, prompt: list[int]) -> LookupOutcome | None:
        cached = self.lookups.get(req_id)
        if cached is not None:
            return cached[1]
        text = self.token_text.text(prompt)
        outcome = None
        if len(prompt) >= self.options.min_tokens:
            outcome = self.store.lookup(text, prompt, self.ctx_size, self.quant_bits)
            if not outcome.hit or outcome.agreed_tokens < outcome.entry_tokens:
                outcome = self._visible_lookup(prompt, outcome)
        self.lookups[req_id] = (len(text), outcome)
        return outcome

    def _visible_lookup(self, prompt: list[int], outcome: LookupOutcome) -> LookupOutcome:
        """A prompt that carries an earlier answer's hidden reasoning (the API server reused that
        state, README "Text-keyed reuse") is also looked up by its visible text: a file the ds4
        engine keyed that way (ext bit 2) holds those very ids. Used only when all its ids agree."""
        visible = self.token_text.visible_text(prompt)
        if visible is None:
            return outcome
        other = self.store.lookup(visible, prompt, self.ctx_size, self.quant_bits)
        if (
            other.hit
            and other.agreed_tokens == other.entry_tokens
            and (not outcome.hit or other.agreed_tokens > outcome.agreed_tokens)
        ):
            return other
        return outcome

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Called after allocation; for an async load vLLM calls it again (with 0) once loaded."""
        pending = self.pending_loads.get(request.request_id)
        if pending is None or pending.scheduled:
            return
        if num_external_tokens == 0:
            del self.pending_loads[request.request_id]
            return
        pending.scheduled = True
        self.store.pin(pending.outcome.file_path())
        state = self.requests.get(request.request_id)
        if state is not None:
            state.disk_tokens = num_external_tokens

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Ds4DiskMetadata:
        meta = Ds4DiskMetadata()
        for req_id, pending in list(self.pending_loads.items()):
            if not pending.scheduled:
                continue
            del self.pending_loads[req_id]
            outcome = pending.outcome
            meta.loads.append(LoadJob(req_id, outcome, pending.start, self._block_ids(req_id)))
            self.loading[req_id] = outcome
            state = self.requests[req_id]
            state.last_stored = outcome.entry_tokens
            state.saved.add(outcome.entry_tokens)
            state.decision = _with(
                state.decision,
                disk_cached_tokens=outcome.entry_tokens,
                disk_file=outcome.path,
                disk_entry_tokens=outcome.entry_tokens,
                disk_in_flight=outcome.in_flight,
            )

        for new in scheduler_output.scheduled_new_reqs:
            self._plan_request(new.req_id, new.num_computed_tokens)
            self._add_saves(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self._add_saves(meta, req_id, computed, scheduler_output)

        meta.saves.extend(self.finished_saves)
        self.finished_saves = []
        meta.release_kept, self.release_kept = self.release_kept, []
        if self.shutdown_requested and not self.shutdown_saved:
            self._add_shutdown_saves(meta, scheduler_output)
        return meta

    def _add_shutdown_saves(self, meta: Ds4DiskMetadata, output: SchedulerOutput) -> None:
        """The state every request holds after this step, saved as `shutdown` and flushed."""
        self.shutdown_saved = True
        ends = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        ends.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        saved = 0
        for req_id, computed in ends.items():
            state = self.requests.get(req_id)
            end = computed + output.num_scheduled_tokens.get(req_id, 0)
            if state is None or end < self.options.min_tokens or end <= state.last_stored:
                continue
            job = self._save_job(
                req_id, state, SaveDecision(end, SaveReason.SHUTDOWN), self._block_ids(req_id)
            )
            if job is not None:
                job.flush = True
                meta.saves.append(job)
                state.last_stored = end
                state.saved.add(end)
                saved += 1
        logger.info("kv cache shutdown: saving the state of %d running requests", saved)

    def _plan_request(self, req_id: str, cached_tokens: int) -> None:
        state = self.requests.get(req_id)
        if state is None or state.traced:
            return
        prompt = state.request.prompt_token_ids or []
        outcome = self.lookups.get(req_id, (0, None))[1]
        shared = self.token_text.line_prefix(prompt, outcome.shared_bytes) if outcome else 0
        state.planned = plan_prefill_saves(
            self.options, prompt, cached_tokens, self.user_id, self.assistant_id, shared
        )
        state.answer_start = answer_start(prompt, self.assistant_id)
        if not state.decision:
            state.decision = CacheDecision(len(prompt), self.lookups.get(req_id, (0, None))[0])
        state.decision = _with(
            state.decision,
            vllm_cached_tokens=max(0, cached_tokens - state.decision.disk_cached_tokens)
            if state.decision.disk_cached_tokens
            else cached_tokens,
            shared_tokens=shared,
            planned_saves=tuple(state.planned),
        )
        state.traced = True
        if self.trace is not None:
            self.trace.request(req_id, state.decision)
        if state.decision.disk_cached_tokens == 0:
            self.store.record_miss()

    def _add_saves(self, meta: Ds4DiskMetadata, req_id: str, computed: int, output: SchedulerOutput) -> None:
        state = self.requests.get(req_id)
        if state is None:
            return
        end = computed + output.num_scheduled_tokens.get(req_id, 0)
        points = [d for d in state.planned if computed < d.tokens <= end]
        step = self.options.continued_step
        prompt_len = len(state.request.prompt_token_ids or [])
        if step and end > prompt_len:  # continued saves while decoding
            first = max(computed, prompt_len) // step + 1
            points += [
                SaveDecision(m * step, SaveReason.CONTINUED)
                for m in range(first, end // step + 1)
                if m * step >= self.options.min_tokens
            ]
        for point in points:
            if point.tokens <= state.last_stored:
                continue
            job = self._save_job(req_id, state, point, self._block_ids(req_id))
            if job is not None:
                meta.saves.append(job)
                state.saved.add(point.tokens)
            state.last_stored = point.tokens
        start = state.answer_start
        if computed < start <= end and start >= self.options.min_tokens and start not in state.saved:
            meta.keep.append(KeepAnswerStart(req_id, start, self._block_ids(req_id)))
            state.kept = True

    def _save_job(
        self, req_id: str, state: RequestState, point: SaveDecision, block_ids: BlockIds, **kw: Any
    ) -> SaveJob | None:
        """A save the store admitted (budget reserved, visible to lookups), or None."""
        tokens = list(state.request.all_token_ids[: point.tokens])
        text = self.token_text.text(tokens)
        header = KvcHeader.new(
            quant_bits=self.quant_bits, reason=point.reason, tokens=point.tokens, ctx_size=self.ctx_size
        )
        tool_map = self._tool_map(state).entries(text)
        admission = self.store.admit(
            text, tokens, header, self._file_size(len(text), point.tokens, tool_map), conversation_key=req_id
        )
        if admission.ticket is None:
            return None
        if self.trace is not None:
            self.trace.event(f"save request={req_id} {point} file={admission.ticket.path}")
        return SaveJob(req_id, admission.ticket, header, text, tokens, block_ids, tool_map=tool_map, **kw)

    def _tool_map(self, state: RequestState) -> RequestToolMap:
        """The request's tool-call ids for KTM trailers (from its kv_transfer_params)."""
        if state.tool_map is None:
            request = state.request
            params = getattr(request, "kv_transfer_params", None)
            prompt_bytes = 0
            if params:  # the lookup measured the prompt's text already; render it only without one
                looked_up = self.lookups.get(request.request_id)
                prompt_bytes = (
                    looked_up[0]
                    if looked_up is not None
                    else len(self.token_text.text(request.prompt_token_ids or []))
                )
            state.tool_map = RequestToolMap(params, prompt_bytes)
        return state.tool_map

    def _file_size(self, text_bytes: int, n_tokens: int, tool_map: Iterable[ToolMapEntry] = ()) -> int:
        n_comp, n_index = self.layout.counts(n_tokens)
        header = PayloadHeader.build(self.layout.dims, ctx_size=self.ctx_size, n_tokens=n_tokens)
        return self.store.file_size(text_bytes, payload_size(header, n_comp, n_index), tool_map)

    def _block_ids(self, req_id: str) -> BlockIds:
        if self.kv_cache_manager is None:
            raise RuntimeError("ds4disk: vLLM never bound its KV cache manager to the connector")
        return tuple(list(ids) for ids in self.kv_cache_manager.get_block_ids(req_id))

    # ------------------------------------------------------------------ finish

    def worker_results(
        self, loaded: set[str], failed: set[str], worker_meta: Ds4DiskWorkerMetadata | None
    ) -> None:
        """What the worker did last step: writes ended, loads done or failed."""
        reports = worker_meta.loads if worker_meta is not None else {}
        for write in worker_meta.writes if worker_meta is not None else ():
            self.store.finish_write(write)
        for req_id in loaded | failed:
            outcome = self.loading.pop(req_id, None)
            if outcome is None:
                continue
            ok = req_id not in failed
            report = reports.get(req_id) or LoadReport(outcome.file_path(), ok, "" if ok else "load failed")
            self.store.finish_load(outcome, report)
            self.store.unpin(outcome.file_path())
        for req_id in failed:
            # vLLM resets the request to recompute; it must not be offered the file again.
            self.lookups[req_id] = (self.lookups.get(req_id, (0, None))[0], None)
            state = self.requests.get(req_id)
            if state is not None:
                state.last_stored = 0
                state.disk_tokens = 0
                state.decision = _with(state.decision, disk_cached_tokens=0, disk_miss_reason="load failed")

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        state = self.requests.pop(req_id, None)
        self.lookups.pop(req_id, None)
        pending = self.pending_loads.pop(req_id, None)
        if pending is not None and pending.scheduled:
            self.store.unpin(pending.outcome.file_path())
        loading = self.loading.pop(req_id, None)
        if loading is not None:
            self.store.unpin(loading.file_path())
        if state is None:
            return False, None
        # How many prompt tokens came from disk, for the API server's usage fields
        # (ds4_vllm.serving.request_outputs reads it off the request's final output).
        params = {DISK_TOKENS_PARAM: state.disk_tokens}
        jobs = self._finished_jobs(request, state, tuple(list(ids) for ids in block_ids))
        if state.kept and not any(job.from_kept for job in jobs):
            self.release_kept.append(req_id)
        self.finished_saves.extend(jobs)
        return bool(jobs), params

    def _finished_jobs(self, request: Request, state: RequestState, block_ids: BlockIds) -> list[SaveJob]:
        """The finished conversation's whole state (prompt + generated, less the last sampled
        token, which was never fed), while vLLM still holds it; or, when the answer will not come
        back as generated and the worker kept the frontier where it starts, the state there.
        Requests vLLM aborts on the way out of a stop are saved both ways, as `shutdown`: as ds4
        saves its live state, and for the client's retry of the same prompt."""
        shutdown = self.shutdown_requested
        decisions: list[tuple[SaveDecision | None, bool]] = []  # (save, from the kept frontier)
        # Without a frontier, as ds4 does; unless a file already holds the answer's start (the
        # request loaded it), and then a state after an answer that does not come back is no use.
        known = state.answer_start in state.saved
        comes_back = (not state.kept and not known) or self._answer_comes_back(request)
        if comes_back or shutdown:
            whole = finished_save(
                self.options, request.num_computed_tokens, state.last_stored, shutdown=shutdown
            )
            decisions.append((whole, False))
        if not comes_back:
            start = answer_start_save(self.options, state.answer_start, state.saved, shutdown=shutdown)
            decisions.append((start, True))
        jobs: list[SaveJob] = []
        for decision, from_kept in decisions:
            if decision is None or (from_kept and jobs and jobs[0].ticket.n_tokens == decision.tokens):
                continue
            job = self._save_job(
                request.request_id,
                state,
                decision,
                block_ids,
                after_finish=True,
                flush=shutdown,
                from_kept=from_kept,
            )
            if job is not None:
                jobs.append(job)
        return jobs

    def _answer_comes_back(self, request: Request) -> bool:
        """`store.answer_comes_back` for a finished vLLM request."""
        from vllm.v1.request import RequestStatus

        if request.status == RequestStatus.FINISHED_ABORTED:
            end = AnswerEnd.ABORTED
        elif request.status == RequestStatus.FINISHED_LENGTH_CAPPED or (
            request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None
        ):
            end = AnswerEnd.ENDED
        else:
            end = AnswerEnd.STOPPED
        prompt = request.prompt_token_ids or []
        output = list(request.all_token_ids[len(prompt) :])
        return answer_comes_back(
            end,
            prompt,
            output,
            self.token_text.text(output),
            (self.assistant_id, self.think_start_id, self.think_end_id),
        )

    def _on_shutdown_signal(self) -> None:
        if not self.shutdown_requested:
            self.shutdown_requested = True
            logger.info("kv cache shutdown requested: running requests will be saved as 'shutdown'")

    def shutdown(self) -> None:
        self.store.close()
        if self.trace is not None:
            self.trace.close()


def _chain_shutdown_signal(callback: Callable[[], None]) -> None:
    """Call `callback` on SIGTERM/SIGINT before vLLM's own handler (vLLM has no shutdown hook).

    vLLM's engine core installs its handlers before it builds the scheduler, so chaining here
    keeps them. Outside the main thread (an engine embedded in a thread) nothing is chained.
    """
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            previous = signal.getsignal(signum)

            def handler(sig: int, frame: FrameType | None, previous: Any = previous) -> None:
                callback()
                if callable(previous):
                    previous(sig, frame)
                elif previous == signal.SIG_DFL:  # what the signal would have done without us
                    signal.signal(sig, signal.SIG_DFL)
                    os.kill(os.getpid(), sig)

            signal.signal(signum, handler)
        except ValueError:  # not the main thread
            return


def _with(decision: CacheDecision | None, **changes: Any) -> CacheDecision:
    base = decision if decision is not None else CacheDecision(0, 0)
    return dataclasses.replace(base, **changes)
