"""The one exception the kvc package raises for bad bytes or bad writer input."""

from __future__ import annotations

import os


class KvcFormatError(ValueError):
    """A KVC file (or data given to the writer) breaks the format.

    Attributes:
        path: the file concerned, or None for an in-memory buffer / writer input.
        offset: absolute byte offset in the file where the problem sits, or None.
        field: the field that is wrong, e.g. "header.magic", "payload.n_comp[3]", "ktm.entry[2].id_len".
        reason: what is wrong, in words.

    Operating-system failures (missing file, permission denied) are raised as OSError,
    not as this type: they say nothing about the bytes.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        offset: int | None,
        field: str,
        reason: str,
    ) -> None:
        self.path = None if path is None else os.fspath(path)
        self.offset = offset
        self.field = field
        self.reason = reason
        super().__init__(self._message())

    def _message(self) -> str:
        where = self.path if self.path is not None else "<buffer>"
        at = f" at byte {self.offset}" if self.offset is not None else ""
        return f"{where}: {self.field}{at}: {self.reason}"

    def __reduce__(
        self,
    ) -> tuple[
        type[KvcFormatError], tuple[object, ...]
    ]:  # keep pickling (multiprocessing) working with the 4-arg constructor
        return (type(self), (self.path, self.offset, self.field, self.reason))
