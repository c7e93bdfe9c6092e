"""Counters of the disk cache, as a plain dataclass the connector exports as metrics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class StoreStats:
    """Totals since the store opened, kept by whichever side counts each; read a `snapshot()`."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    tokens_loaded: int = 0
    bytes_read: int = 0
    load_seconds: float = 0.0
    stores: int = 0
    store_skips: int = 0
    bytes_written: int = 0
    save_seconds: float = 0.0
    save_wait_seconds: float = 0.0
    saves_dropped: int = 0
    files_evicted: int = 0
    files_deduplicated: int = 0
    files_quarantined: int = 0
    failures: int = 0

    def snapshot(self) -> StoreStats:
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)
