"""Frontiers the worker keeps in host memory until a request's finish says whether to save them.

A request's state where its answer starts (`ds4_vllm.store.answer_start`) is what a follow-up
shares when the answer will not come back as generated, but that is known only at the finish,
when the window rows of that position may already be released. The frontier (raw window rows,
the compressors' open windows, the next-token logits) is a few hundred rows however long the
context; the compressed rows below it never change, so the save reads those from the cache.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from ds4_vllm.model.kv_layout import Frontier

logger = logging.getLogger(__name__)

#: Host memory all kept frontiers may hold together; a request beyond it keeps none (its finish
#: then saves as ds4 does).
MAX_KEPT_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True, slots=True)
class KeptFrontier:
    n_tokens: int
    logits: np.ndarray
    frontier: list[Frontier]

    @property
    def nbytes(self) -> int:
        return self.logits.nbytes + sum(a.nbytes for layer in self.frontier for a in layer.values())


class KeptFrontiers:
    """Frontiers by request id, bounded by bytes. Owned by the worker; its thread only."""

    def __init__(self, max_bytes: int = MAX_KEPT_BYTES) -> None:
        self.max_bytes = max_bytes
        self._kept: dict[str, KeptFrontier] = {}
        self._nbytes = 0
        self._warned = False

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def keep(self, req_id: str, kept: KeptFrontier) -> bool:
        self.release(req_id)  # a preempted request computes its prompt again
        if self._nbytes + kept.nbytes > self.max_bytes:
            if not self._warned:
                self._warned = True
                logger.info(
                    "kv cache: %d answer-start frontiers hold %d MiB; later requests keep none",
                    len(self._kept),
                    self._nbytes >> 20,
                )
            return False
        self._kept[req_id] = kept
        self._nbytes += kept.nbytes
        return True

    def take(self, req_id: str, n_tokens: int) -> KeptFrontier | None:
        """The request's frontier if it was kept at `n_tokens`; released either way."""
        kept = self._kept.get(req_id)
        self.release(req_id)
        return kept if kept is not None and kept.n_tokens == n_tokens else None

    def release(self, req_id: str) -> None:
        kept = self._kept.pop(req_id, None)
        if kept is not None:
            self._nbytes -= kept.nbytes
