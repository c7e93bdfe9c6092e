"""What the microbenchmarks measure (issue 11), as data: one class per part, and the goals of (c)."""

from __future__ import annotations

import dataclasses
from typing import Any

#: Issue 11's goal for (c): a restore after a restart at least this much faster than cold...
MIN_RESTART_SPEEDUP = 20.0
#: ...and within this factor of reading the file sequentially plus prefilling the suffix.
MAX_OVER_BOUND = 1.5


@dataclasses.dataclass(frozen=True)
class ThroughputRow:
    """(a) at one prompt length: medians of the save/restore and plain write/read runs (seconds)."""

    model: str
    tokens: int
    file_mib: float
    save_s: float
    sequential_write_s: float
    restore_s: float
    sequential_read_s: float
    resident_after_drop: float  # the largest fraction of a file's pages still cached after a drop
    all_save_s: list[float]
    all_write_s: list[float]
    all_restore_s: list[float]
    all_read_s: list[float]

    @property
    def save_mib_s(self) -> float:
        return self.file_mib / self.save_s

    @property
    def restore_mib_s(self) -> float:
        return self.file_mib / self.restore_s

    @property
    def save_over_write_time(self) -> float:
        return self.save_s / self.sequential_write_s

    @property
    def restore_over_read_time(self) -> float:
        return self.restore_s / self.sequential_read_s


@dataclasses.dataclass(frozen=True)
class LookupRow:
    """(b) with `entries` checkpoint files in the directory: what one lookup costs (milliseconds)."""

    entries: int
    median_ms: float
    p90_ms: float
    p99_ms: float
    p99_cpu_ms: float  # CPU time of the calling thread: on a loaded machine the wall p99 is preemption
    first_lookup_ms: float
    lookup_unchanged_rescan_ms: float
    lookup_after_change_ms: float
    rescan_ms: float
    hit_tokens: int
    prompt_tokens: int
    calls: int
    populate_s: float


@dataclasses.dataclass(frozen=True)
class EnginePhase:
    """One engine process of (c): its prompt's time to first token; `restored` adds the reuse."""

    engine_start_s: float
    prompt_tokens: int
    ttft_s: float
    load_ms_logged: list[float] = dataclasses.field(default_factory=list)
    num_cached_tokens: int | None = None
    suffix_prefill_s: float | None = None  # median prefill of a fresh suffix-length prompt
    suffix_prefill_all_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RestartResult:
    """(c): engine A's cold prefill against engine B's restore of it after a restart."""

    model: str
    prompt_tokens: int
    suffix_tokens: int
    cold: EnginePhase
    restored: EnginePhase
    files: list[dict[str, Any]]  # each checkpoint file A left: name and bytes
    restored_file_payload_header: dict[str, Any]
    resident_before_restore: float
    sequential_read_s: float

    @property
    def speedup_vs_cold(self) -> float:
        return self.cold.ttft_s / self.restored.ttft_s

    @property
    def restored_over_read_plus_suffix(self) -> float:
        return self.restored.ttft_s / (self.sequential_read_s + (self.restored.suffix_prefill_s or 0.0))

    @property
    def met(self) -> bool:
        return (
            self.speedup_vs_cold >= MIN_RESTART_SPEEDUP
            and self.restored_over_read_plus_suffix <= MAX_OVER_BOUND
        )


@dataclasses.dataclass
class MicroResults:
    """Everything one microbenchmark run measured, with the machine it ran on."""

    quick: bool
    machine: dict[str, Any]
    page_cache: dict[str, Any]
    throughput: dict[str, list[ThroughputRow]] = dataclasses.field(default_factory=dict)
    lookup: list[LookupRow] = dataclasses.field(default_factory=list)
    restart: RestartResult | None = None
    load_average_end: tuple[float, float, float] | None = None
    wall_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON form, with the derived ratios written out beside the figures they come from."""
        data = dataclasses.asdict(self)
        for rows, out in zip(self.throughput.values(), data["throughput"].values(), strict=True):
            for row, row_out in zip(rows, out, strict=True):
                for name in ("save_mib_s", "restore_mib_s", "save_over_write_time", "restore_over_read_time"):
                    row_out[name] = getattr(row, name)
        if self.restart is not None:
            for name in ("speedup_vs_cold", "restored_over_read_plus_suffix", "met"):
                data["restart"][name] = getattr(self.restart, name)
        return {"benchmark": "micro", **data}
