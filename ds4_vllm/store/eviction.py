"""ds4's disk-budget eviction rule (spec §5.5), as pure functions: no I/O, no clock.

The `ds4-kv gc` command and the connector's store both feed entries in and delete the
victims they get back, so the two always agree on what goes first.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable

#: DS4_KVSTORE_HIT_HALF_LIFE_SECONDS: a hit counts half as much after 6 h.
HIT_HALF_LIFE_SECONDS = 21600
#: KV_CACHE_MIN_EFFECTIVE_HITS: decayed hit counts below this are treated as no hits.
MIN_EFFECTIVE_HITS = 0.01
#: DS4_KVSTORE_DEFAULT_MB: the budget when none is given (4096 MiB).
DEFAULT_BUDGET_MB = 4096
MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class EvictionEntry:
    """What the rule needs to know about one valid checkpoint file (header fields + st_size)."""

    path: str
    file_size: int
    tokens: int
    hits: int
    created_at: int
    last_used: int


def effective_hits(hits: int, last_used: int, created_at: int, now: float) -> float:
    """Hits decayed with a 6 h half-life since the last use (or creation when never used)."""
    used_at = last_used if last_used != 0 else created_at
    if used_at == 0:
        return 0.0
    if now > used_at:
        eff = hits * 2.0 ** (-(now - used_at) / HIT_HALF_LIFE_SECONDS)
        return 0.0 if eff < MIN_EFFECTIVE_HITS else eff
    return float(hits)


def eviction_score(entry: EvictionEntry, now: float, *, protected: bool = False) -> float:
    """(effective hits + 1) * tokens / file bytes: tokens kept per byte; lowest goes first.

    The protected file (the one just written) scores +inf; an empty file scores 0.
    """
    if protected:
        return math.inf
    if entry.file_size <= 0:
        return 0.0
    eff = effective_hits(entry.hits, entry.last_used, entry.created_at, now)
    return (eff + 1.0) * entry.tokens / entry.file_size


def _same_path(a: str, b: str | os.PathLike[str] | None) -> bool:
    return b is not None and os.path.normpath(a) == os.path.normpath(os.fspath(b))


def plan_eviction(
    entries: Iterable[EvictionEntry],
    budget_bytes: int,
    now: float,
    protected_path: str | os.PathLike[str] | None = None,
) -> list[EvictionEntry]:
    """The files to delete, in deletion order, so that the total size is <= budget_bytes.

    ds4 deletes the lowest score while total > budget (strict), ties to the smaller
    last_used. Protection is dropped when the protected file alone exceeds the budget.
    Scores do not change during a pass, so one sort gives ds4's order; the path breaks
    remaining ties so the plan is deterministic.
    """
    items = list(entries)
    total = sum(e.file_size for e in items)
    if total <= budget_bytes:
        return []
    protected = [e for e in items if _same_path(e.path, protected_path)]
    keep_protected = bool(protected) and all(e.file_size <= budget_bytes for e in protected)

    def key(e: EvictionEntry) -> tuple[float, int, str]:
        is_protected = keep_protected and _same_path(e.path, protected_path)
        return (eviction_score(e, now, protected=is_protected), e.last_used, e.path)

    victims: list[EvictionEntry] = []
    for entry in sorted(items, key=key):
        if total <= budget_bytes:
            break
        if keep_protected and _same_path(entry.path, protected_path):
            break  # only the protected file is left and it fits: ds4 stops here too
        victims.append(entry)
        total -= entry.file_size
    return victims
