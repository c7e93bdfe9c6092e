"""Files the store must not lose track of: pinned for a pending load, or admitted and not yet written.

Owned by `CheckpointStore` (scheduler side). Pins keep a file from eviction and nested-copy
removal until its load ends. In-flight writes reserve their budget and stay findable by
lookups until the worker reports them, so a conversation's next turn never misses the state
its previous turn just handed to the writer.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from ds4_vllm.kvc import common_prefix

from .records import WriteTicket


@dataclasses.dataclass(frozen=True, slots=True)
class InFlightWrite:
    ticket: WriteTicket
    text: bytes = dataclasses.field(repr=False)
    tokens: tuple[int, ...] = dataclasses.field(repr=False)


class PendingFiles:
    """Pins (path -> count) and in-flight writes (sha1 -> write)."""

    def __init__(self) -> None:
        self._pins: collections.Counter[str] = collections.Counter()
        self._writes: dict[str, InFlightWrite] = {}

    # ------------------------------------------------------------------ pins

    def pin(self, path: str) -> None:
        self._pins[path] += 1

    def unpin(self, path: str) -> None:
        self._pins[path] -= 1
        if self._pins[path] <= 0:
            del self._pins[path]

    @property
    def pinned(self) -> frozenset[str]:
        return frozenset(self._pins)

    # ------------------------------------------------------------------ in-flight writes

    def add_write(self, ticket: WriteTicket, text: bytes, tokens: Sequence[int]) -> None:
        self._writes[ticket.sha1] = InFlightWrite(ticket, bytes(text), tuple(tokens))

    def finish_write(self, sha1: str) -> InFlightWrite | None:
        return self._writes.pop(sha1, None)

    def write(self, sha1: str) -> InFlightWrite | None:
        return self._writes.get(sha1)

    @property
    def writes(self) -> list[InFlightWrite]:
        return list(self._writes.values())

    def shared_prefix(self, prompt_text: bytes) -> int:
        """The most leading bytes of `prompt_text` an in-flight write's text shares with it."""
        return max((common_prefix(prompt_text, w.text) for w in self._writes.values()), default=0)

    def longest_prefix_write(self, prompt_text: bytes, min_tokens: int) -> InFlightWrite | None:
        """The in-flight write with the longest text that is a byte prefix of `prompt_text`."""
        best: InFlightWrite | None = None
        for w in self._writes.values():
            t = w.ticket
            if t.n_tokens < min_tokens or t.text_bytes > len(prompt_text):
                continue
            if best is not None and (t.text_bytes, t.n_tokens) <= (
                best.ticket.text_bytes,
                best.ticket.n_tokens,
            ):
                continue
            if prompt_text.startswith(w.text):
                best = w
        return best
