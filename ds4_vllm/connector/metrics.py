"""ds4disk counters through vLLM's connector stats and its Prometheus endpoint.

Both connector halves report the growth of their store's counters each step
(`StatsDelta`); vLLM sums them (`Ds4DiskStats.aggregate`) and hands the sum to
`Ds4DiskPromMetrics.observe` in the API server, which adds it to counters named
``vllm:ds4disk_<counter>_total`` (seconds counters end in ``_seconds_total``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ds4_vllm.store import StoreStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

#: Exported counters and their help text. Keys are StoreStats fields.
COUNTERS = {
    "hits": "Requests that loaded a checkpoint from disk",
    "misses": "Requests that found no usable checkpoint on disk",
    "tokens_loaded": "Prompt tokens restored from disk instead of computed",
    "bytes_read": "Bytes of checkpoint files loaded",
    "bytes_written": "Bytes of checkpoint files written",
    "load_seconds": "Time spent restoring checkpoints",
    "save_seconds": "Time spent writing checkpoints (background writer)",
    "save_wait_seconds": "Time engine steps waited for room in the writer queue (back-pressure)",
    "saves_dropped": "Checkpoints not saved because the writer queue stayed full (--kv-write-queue-mb)",
    "files_evicted": "Checkpoint files removed to stay within --kv-disk-space-mb",
    "failures": "Failed loads and stores (each fell back to recomputation)",
}


def metric_name(key: str) -> str:
    suffix = "_seconds_total" if key.endswith("_seconds") else "_total"
    return f"vllm:ds4disk_{key.removesuffix('_seconds')}{suffix}"


class StatsDelta:
    """Turns a store's running totals into per-step increments."""

    def __init__(self) -> None:
        self.last = StoreStats()

    def take(self, current: StoreStats) -> dict[str, float]:
        delta = {k: getattr(current, k) - getattr(self.last, k) for k in COUNTERS}
        self.last = current
        return {k: v for k, v in delta.items() if v}


@dataclass
class Ds4DiskStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> Ds4DiskStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Ds4DiskPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[tuple[str, int], Any] = {}
        for key, help_text in COUNTERS.items():
            counter = self._counter_cls(name=metric_name(key), documentation=help_text, labelnames=labelnames)
            for engine, values in per_engine_labelvalues.items():
                self.counters[(key, engine)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            counter = self.counters.get((key, engine_idx))
            if counter is not None and value > 0:
                counter.inc(value)
