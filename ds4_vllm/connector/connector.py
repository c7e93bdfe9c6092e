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
from typing import Any

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
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    model = vllm_config.model_config.model
    fingerprint = model_fingerprint(model, vllm_config.model_config.revision)
    options = StoreOptions.from_extra_config(extra).for_model(f"{model_label(model)}-{fingerprint[:12]}")
    return options, fingerprint


def kv_layout(vllm_config: VllmConfig, kv_cache_config) -> Ds4KVLayout:
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
    policy = vllm_config.kv_transfer_config.kv_load_failure_policy
    if policy != "recompute":
        raise ValueError(
            f"ds4disk needs kv_transfer_config.kv_load_failure_policy = 'recompute' (got {policy!r}): "
            "a checkpoint that cannot be loaded must be recomputed, not fail the request. "
            'Add "kv_load_failure_policy": "recompute" to --kv-transfer-config, or use --kv-connector ds4disk.'
        )


class Ds4DiskConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        options, fingerprint = store_options(vllm_config)
        layout = kv_layout(vllm_config, kv_cache_config)
        self.scheduler = None
        self.worker = None
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

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save lost to preemption is a later miss, never a wrong answer."""
        return False

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        # A checkpoint restores every group (raw window, compressed rows, frontiers).
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        self.scheduler.worker_results(
            set(connector_output.finished_recving or ()),
            set(connector_output.failed_recving or ()),
            worker_meta if isinstance(worker_meta, Ds4DiskWorkerMetadata) else None,
        )

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._connector_metadata if isinstance(self._connector_metadata, Ds4DiskMetadata) else None
        self.worker.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.worker.take_results()
        return KVConnectorTransferResults(sending, recving, failed)

    def build_connector_worker_meta(self) -> Ds4DiskWorkerMetadata | None:
        return self.worker.take_worker_meta()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    # ------------------------------------------------------------------ metrics (both sides)

    def get_kv_connector_stats(self) -> Ds4DiskStats | None:
        stats = self.scheduler.store.stats if self.scheduler is not None else self.worker.stats.snapshot()
        delta = self.stats_delta.take(stats)
        return Ds4DiskStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Ds4DiskStats:
        return Ds4DiskStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> Ds4DiskPromMetrics:
        return Ds4DiskPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
