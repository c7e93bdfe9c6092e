"""Write a file or directory under a temporary name beside its final path, then rename it into place.

Every writer of a product file (checkpoints, the default model, embedded GGUFs, tokenizer
directories, the store's small side files) goes through `atomic_output`: a reader sees the old
file or the whole new one, never a part, and a failed or interrupted write leaves no temp entry
behind (a killed process does; the store's start-up sweep removes those of checkpoints).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


def temp_name(final_name: str, prefix: str = ".") -> str:
    """A name no other writer picks: the final name, ``.tmp.``, this process id and random hex."""
    return f"{prefix}{final_name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"


@contextlib.contextmanager
def atomic_output(
    final: str | os.PathLike[str],
    *,
    directory: bool = False,
    temp: str | os.PathLike[str] | None = None,
    mode: int | None = None,
    first_writer_wins: bool = False,
) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``final``; rename it over ``final`` when the block succeeds.

    ``directory``: the temporary path is created as an empty directory; otherwise the caller
    creates the file (exclusively, with its own flags). ``mode`` is applied before the rename.
    ``first_writer_wins``: when the rename fails because another process already put ``final``
    in place (a non-empty directory), keep theirs. The temporary entry is removed on any error.
    """
    final = Path(final)
    tmp = Path(temp) if temp is not None else final.with_name(temp_name(final.name))
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (first_writer_wins and final.exists()):
                raise
    finally:
        if directory:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
