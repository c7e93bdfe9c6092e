"""The worker side of the disk cache: write an admitted checkpoint, open a chosen one and verify it.

Holds no policy state: what to write, where and whether it fits was decided by the scheduler
side (`CheckpointStore.admit`), which learns how each write ended from the `WriteReport`.
Every load is verified: the file's name is the SHA-1 of its text, its text is the one the
lookup chose, its tokens agree with the lookup's and its dims are the model's. Anything else
is a `LoadFailure`, which the connector turns into a recompute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from ds4_vllm.kvc import Checkpoint, KvcFormatError, KvcHeader, ModelDims, ToolMapEntry

from .catalog import LogOnce
from .eviction import MIB
from .fs import CheckpointFS
from .records import LoadFailure, LookupOutcome, WriteReport, WriteTicket, os_reason, tokens_digest

logger = logging.getLogger(__name__)


class CheckpointWriter:
    def __init__(self, fs: CheckpointFS, model_dims: ModelDims | None) -> None:
        self.fs = fs
        self.model_dims = model_dims
        self._log_once = LogOnce()

    def write(
        self,
        ticket: WriteTicket,
        text: bytes,
        header: KvcHeader,
        payload: Any,
        tool_map: Iterable[ToolMapEntry] = (),
    ) -> WriteReport:
        """Write one admitted checkpoint. Never raises for I/O: the report says what happened."""
        label = header.reason_name
        free = self.fs.free_bytes()
        if free is not None and free < ticket.file_size:
            return self._failed(
                ticket, header, f"disk full: {free} bytes free, file needs {ticket.file_size}"
            )
        started = time.monotonic()
        try:
            path = self.fs.write(bytes(text), header, payload, list(tool_map))
        except OSError as exc:
            return self._failed(ticket, header, os_reason(exc))
        except KvcFormatError as exc:  # the caller handed inconsistent data: a bug, not a disk problem
            return self._failed(ticket, header, f"invalid checkpoint data: {exc}")
        seconds = time.monotonic() - started
        logger.info(
            "kv cache stored tokens=%d reason=%s text=%d size=%.1f MiB save=%.1f ms file=%s",
            header.tokens,
            label,
            ticket.text_bytes,
            ticket.file_size / MIB,
            seconds * 1000,
            path,
        )
        return WriteReport(ticket.sha1, path, True, label, ticket.file_size, seconds)

    def _failed(self, ticket: WriteTicket, header: KvcHeader, why: str) -> WriteReport:
        self._log_once.warning(
            f"store:{why.split(':')[0]}",
            "kv cache store failed (%s): tokens=%d %s",
            header.reason_name,
            header.tokens,
            why,
        )
        return WriteReport(ticket.sha1, ticket.path, False, why)

    def open_verified(self, outcome: LookupOutcome) -> Checkpoint:
        """Open the file a lookup chose and check it is still that file; close it after copying.

        Raises LoadFailure (`corrupt` for a damaged file) when the file vanished, is corrupt,
        is another model's, or is not the text and tokens the lookup saw.
        """
        path = outcome.path
        if not outcome.hit or path is None:
            raise LoadFailure(str(path), "not a hit")
        try:
            ck = self.fs.open(path)
        except FileNotFoundError as exc:
            raise LoadFailure(path, "file removed by another process") from exc
        except KvcFormatError as exc:
            raise LoadFailure(path, f"corrupt file: {exc.field}: {exc.reason}", corrupt=True) from exc
        except OSError as exc:
            raise LoadFailure(path, f"unreadable file: {os_reason(exc)}") from exc
        try:
            dims = ck.payload.header.dims
            if self.model_dims is not None and dims != self.model_dims:
                raise LoadFailure(path, f"written for another model shape {dims}")
            tokens = np.asarray(ck.payload.tokens)
            if ck.sha1 != outcome.sha1:
                raise LoadFailure(
                    path, f"file replaced since the lookup: text SHA-1 {ck.sha1} != {outcome.sha1}"
                )
            if ck.header.tokens != outcome.entry_tokens:
                raise LoadFailure(
                    path,
                    f"file replaced since the lookup: {ck.header.tokens} tokens != {outcome.entry_tokens}",
                )
            if tokens_digest(tokens[: outcome.agreed_tokens]) != outcome.tokens_digest:
                raise LoadFailure(path, "file replaced since the lookup: its tokens differ")
        except LoadFailure:
            ck.close()
            raise
        return ck
