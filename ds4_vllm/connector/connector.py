"""``ds4disk``: vLLM KV connector keeping DeepSeek V4 state as KVC checkpoint files on disk.

A facade: the constructor translates vLLM's config once and builds the half for
its role; every hook delegates. Scheduler side (engine core, owns the store):
``get_num_new_matched_tokens`` (lookup, may repeat), ``update_state_after_alloc``,
``build_connector_meta`` (load and save jobs), ``update_connector_output`` (how the
worker's loads and writes ended), ``request_finished_all_groups`` (save a finished
conversation, holding its blocks). Worker side: ``register_kv_caches``,
``start_load_kv`` (loads, finished-request saves), ``wait_for_save`` (in-step saves),
``get_transfer_results`` and ``build_connector_worker_meta`` (results back).
Loads are asynchronous, so a failed one takes vLLM's recompute path.
DS4's cache layers never call the per-layer save/load hooks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ds4_vllm.connector.metadata import Ds4DiskMetadata, Ds4DiskWorkerMetadata
from ds4_vllm.connector.metrics import Ds4DiskPromMetrics, Ds4DiskStats, StatsDelta
from ds4_vllm.model.config import routed_expert_quant_bits
from ds4_vllm.model.kv_layout import Ds4KVLayout
from ds4_vllm.model.parallel import TpGroup
from ds4_vllm.store import StoreOptions
from ds4_vllm.store.model_identity import model_fingerprint, model_label

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from ds4_vllm.connector.scheduler import Ds4DiskScheduler
    from ds4_vllm.connector.worker import Ds4DiskWorker

logger = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """Show ds4_vllm's log lines (kv cache hit/stored/evicted...) through vLLM's handlers and format.

    Records still propagate to the root logger as usual; the forwarding handler only adds
    vLLM's output, which otherwise ignores loggers outside the ``vllm`` namespace.
    """
    ours, theirs = logging.getLogger("ds4_vllm"), logging.getLogger("vllm")
    if any(isinstance(h, _ForwardToVllm) for h in ours.handlers):
        return
    ours.addHandler(_ForwardToVllm(theirs))
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


class _ForwardToVllm(logging.Handler):
    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        # When vLLM's logger propagates, its lines reach the root logger, and so do ours.
        if self.target.propagate:
            return
        # Handlers vLLM shares with the root logger (as under pytest) see our record there.
        shared = logging.getLogger().handlers
        for handler in self.target.handlers:
            if handler not in shared and record.levelno >= handler.level:
                handler.handle(record)


_log_through_vllm()


def store_options(vllm_config: VllmConfig) -> tuple[StoreOptions, str]:
    """The ds4 cache flags from ``kv_connector_extra_config`` (errors name the flag), and the model's fingerprint.

    Without ``--kv-disk-dir`` the checkpoints go to a folder of this model's own.
    """
    transfer = vllm_config.kv_transfer_config
    extra = (transfer.kv_connector_extra_config if transfer is not None else None) or {}
    model = vllm_config.model_config.model
    fingerprint = model_fingerprint(model, vllm_config.model_config.revision)
    options = StoreOptions.from_extra_config(extra).for_model(f"{model_label(model)}-{fingerprint[:12]}")
    return options, fingerprint


def kv_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Ds4KVLayout:
    groups: dict[str, tuple[int, int]] = {}
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            groups[name] = (index, group.kv_cache_spec.block_size)

    def role_of(name: str) -> tuple[int, int]:
        if name not in groups:
            raise ValueError(f"ds4disk: KV cache layer {name!r} not found; is the model Ds4ForCausalLM?")
        return groups[name]

    return Ds4KVLayout(vllm_config.model_config.hf_config, role_of)


def _require_recompute_policy(vllm_config: VllmConfig) -> None:
    """A checkpoint that fails to load must mean "recompute", never a failed request.

    vLLM's default is "fail" and vLLM reads the policy from the config, so it is the user's
    setting (`--kv-connector ds4disk` sets it); anything else is refused, naming the key.
    """
    transfer = vllm_config.kv_transfer_config
    policy = transfer.kv_load_failure_policy if transfer is not None else None
    if policy != "recompute":
        raise ValueError(
            f"ds4disk needs kv_transfer_config.kv_load_failure_policy = 'recompute' (got {policy!r}): "
            "a checkpoint that cannot be loaded must be recomputed, not fail the request. "
            'Add "kv_load_failure_policy": "recompute" to --kv-transfer-config, or use --kv-connector ds4disk.'
        )


class Ds4DiskConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        options, fingerprint = store_options(vllm_config)
        layout = kv_layout(vllm_config, kv_cache_config)
        self.scheduler: Ds4DiskScheduler | None = None
        self.worker: Ds4DiskWorker | None = None
        self.stats_delta = StatsDelta()
        if role == KVConnectorRole.SCHEDULER:
            from ds4_vllm.connector.scheduler import Ds4DiskScheduler

            _require_recompute_policy(vllm_config)
            self.scheduler = Ds4DiskScheduler(vllm_config, options, layout, fingerprint)
        else:
            from ds4_vllm.connector.worker import Ds4DiskWorker

            quant_bits = routed_expert_quant_bits(vllm_config.model_config.hf_config)
            self.worker = Ds4DiskWorker(
                options,
                layout,
                vllm_config.model_config.max_model_len,
                quant_bits,
                writes_files=TpGroup.current().rank == 0,
            )

    def _scheduler_side(self) -> Ds4DiskScheduler:
        if self.scheduler is None:
            raise RuntimeError("ds4disk: a scheduler hook was called on the worker-side connector")
        return self.scheduler

    def _worker_side(self) -> Ds4DiskWorker:
        if self.worker is None:
            raise RuntimeError("ds4disk: a worker hook was called on the scheduler-side connector")
        return self.worker

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save lost to preemption is a later miss, never a wrong answer."""
        return False

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._scheduler_side().kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A checkpoint restores every group (raw window, compressed rows, frontiers).
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        self._scheduler_side().worker_results(
            set(connector_output.finished_recving or ()),
            set(connector_output.failed_recving or ()),
            worker_meta if isinstance(worker_meta, Ds4DiskWorkerMetadata) else None,
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, Ds4DiskMetadata):
            raise TypeError(f"ds4disk: connector metadata is {type(meta).__name__}, not Ds4DiskMetadata")
        self._worker_side().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._connector_metadata if isinstance(self._connector_metadata, Ds4DiskMetadata) else None
        self._worker_side().wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker_side().take_results()
        return KVConnectorTransferResults(sending, recving, failed)

    def build_connector_worker_meta(self) -> Ds4DiskWorkerMetadata | None:
        return self._worker_side().take_worker_meta()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    # ------------------------------------------------------------------ metrics (both sides)

    def get_kv_connector_stats(self) -> Ds4DiskStats | None:
        stats = (
            self.scheduler.store.stats if self.scheduler is not None else self._worker_side().stats.snapshot()
        )
        delta = self.stats_delta.take(stats)
        return Ds4DiskStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Ds4DiskStats:
        return Ds4DiskStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Ds4DiskPromMetrics:
        return Ds4DiskPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
