"""Scheduler side of ds4disk: disk lookups, load jobs and save points, in the engine core.

Everything here is decided from token ids and byte text; the worker side moves
the tensors. vLLM may call ``get_num_new_matched_tokens`` several times for one
request, so it only looks (and remembers the answer); files are touched when a
load is actually scheduled.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput

from ds4_vllm.connector.metadata import Ds4DiskMetadata, LoadJob, SaveJob
from ds4_vllm.connector.token_text import TokenText
from ds4_vllm.kvc import ModelDims, SaveReason
from ds4_vllm.store import (
    CacheDecision,
    CheckpointStore,
    LookupOutcome,
    SaveDecision,
    StoreOptions,
    TraceWriter,
    finished_save,
    plan_prefill_saves,
)

logger = logging.getLogger(__name__)

USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"


@dataclass
class RequestState:
    """What the scheduler side tracks for one live request."""

    request: Any  # vllm.v1.request.Request (its all_token_ids grow as it decodes)
    planned: list[SaveDecision] = field(default_factory=list)
    last_stored: int = 0
    traced: bool = False
    decision: CacheDecision | None = None


@dataclass
class PendingLoad:
    outcome: LookupOutcome
    start: int  # tokens vLLM already had in memory
    scheduled: bool = False  # blocks are allocated; the load goes out in the next metadata


class Ds4DiskScheduler:
    def __init__(self, vllm_config: VllmConfig, options: StoreOptions, dims: ModelDims) -> None:
        model_config = vllm_config.model_config
        self.options = options
        self.ctx_size = model_config.max_model_len
        self.quant_bits = int(getattr(model_config.hf_config, "routed_expert_quant_bits", 4))
        self.token_text = TokenText.from_tokenizer_dir(model_config.tokenizer)
        self.user_id = self.token_text.token_id(USER_TOKEN) or -1
        self.assistant_id = self.token_text.token_id(ASSISTANT_TOKEN) or -1
        self.store = CheckpointStore(options, model_dims=dims).open()
        self.trace = TraceWriter(options.trace) if options.trace else None
        self.kv_cache_manager = None
        self.requests: dict[str, RequestState] = {}
        self.lookups: dict[str, tuple[int, LookupOutcome | None]] = {}
        self.pending_loads: dict[str, PendingLoad] = {}
        self.loading: dict[str, LookupOutcome] = {}  # load jobs sent, result not yet back
        self.finished_saves: list[SaveJob] = []

    # ------------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
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
        self.lookups[req_id] = (len(text), outcome)
        return outcome

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Called after allocation; for an async load vLLM calls it again (with 0) once loaded."""
        pending = self.pending_loads.get(request.request_id)
        if pending is None or pending.scheduled:
            return
        if num_external_tokens == 0:
            del self.pending_loads[request.request_id]
            return
        pending.scheduled = True
        self.store.pin(pending.outcome.path)

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Ds4DiskMetadata:
        meta = Ds4DiskMetadata()
        for req_id, pending in list(self.pending_loads.items()):
            if not pending.scheduled:
                continue
            del self.pending_loads[req_id]
            outcome = pending.outcome
            meta.loads.append(
                LoadJob(req_id, outcome.path, outcome.entry_tokens, pending.start, self._block_ids(req_id))
            )
            self.loading[req_id] = outcome
            state = self.requests[req_id]
            state.last_stored = outcome.entry_tokens
            state.decision = _with(
                state.decision,
                disk_cached_tokens=outcome.entry_tokens,
                disk_file=outcome.path,
                disk_entry_tokens=outcome.entry_tokens,
            )

        for new in scheduler_output.scheduled_new_reqs:
            self._plan_request(new.req_id, new.num_computed_tokens)
            self._add_saves(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self._add_saves(meta, req_id, computed, scheduler_output)

        meta.saves.extend(self.finished_saves)
        self.finished_saves = []
        return meta

    def _plan_request(self, req_id: str, cached_tokens: int) -> None:
        state = self.requests.get(req_id)
        if state is None or state.traced:
            return
        prompt = state.request.prompt_token_ids or []
        state.planned = plan_prefill_saves(
            self.options, prompt, cached_tokens, self.user_id, self.assistant_id
        )
        if not state.decision:
            state.decision = CacheDecision(len(prompt), self.lookups.get(req_id, (0, None))[0])
        state.decision = _with(
            state.decision,
            vllm_cached_tokens=max(0, cached_tokens - state.decision.disk_cached_tokens)
            if state.decision.disk_cached_tokens
            else cached_tokens,
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
            meta.saves.append(self._save_job(req_id, state, point, self._block_ids(req_id)))
            state.last_stored = point.tokens

    def _save_job(self, req_id: str, state: RequestState, point: SaveDecision, block_ids, **kw) -> SaveJob:
        tokens = list(state.request.all_token_ids[: point.tokens])
        return SaveJob(
            req_id, point.tokens, int(point.reason), self.token_text.text(tokens), tokens, block_ids, **kw
        )

    def _block_ids(self, req_id: str):
        return tuple(list(ids) for ids in self.kv_cache_manager.get_block_ids(req_id))

    # ------------------------------------------------------------------ finish

    def load_finished(self, loaded: set[str], failed: set[str]) -> None:
        """Worker results of loads (vLLM passes them on once per step)."""
        for req_id in loaded - failed:
            outcome = self.loading.pop(req_id, None)
            if outcome is not None:
                self.store.unpin(outcome.path)
                self.store.record_hit(outcome)
        for req_id in failed:
            outcome = self.loading.pop(req_id, None)
            if outcome is not None:
                self.store.unpin(outcome.path)
            # vLLM resets the request to recompute; it must not be offered the file again.
            self.lookups[req_id] = (self.lookups.get(req_id, (0, None))[0], None)
            state = self.requests.get(req_id)
            if state is not None:
                state.last_stored = 0
                state.decision = _with(state.decision, disk_cached_tokens=0, disk_miss_reason="load failed")

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        req_id = request.request_id
        state = self.requests.pop(req_id, None)
        self.lookups.pop(req_id, None)
        pending = self.pending_loads.pop(req_id, None)
        if pending is not None and pending.scheduled:
            self.store.unpin(pending.outcome.path)
        loading = self.loading.pop(req_id, None)
        if loading is not None:
            self.store.unpin(loading.path)
        if state is None:
            return False, None
        # The finished conversation's whole state (prompt + generated, less the last sampled
        # token, which was never fed), while vLLM still holds it.
        decision = finished_save(self.options, request.num_computed_tokens, state.last_stored)
        if decision is None:
            return False, None
        job = self._save_job(
            req_id, state, decision, tuple(list(ids) for ids in block_ids), after_finish=True
        )
        self.finished_saves.append(job)
        return True, None

    def shutdown(self) -> None:
        if self.trace is not None:
            self.trace.close()


def _with(decision: CacheDecision | None, **changes) -> CacheDecision:
    base = decision if decision is not None else CacheDecision(0, 0)
    return dataclasses.replace(base, **changes)
