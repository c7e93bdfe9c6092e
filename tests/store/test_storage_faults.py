"""Issue 12: the disk fills in the middle of a write, the directory turns read-only while serving.

Store-level companions of tests/connector/test_failures.py (which runs an engine, and fills the
disk before a save so the free-space check refuses it): here the disk fills between two layers
of a payload being streamed to the temp file, and a tmpfs is remounted read-only under an open
store (root ignores chmod). Each failure is a skipped save or a lost hit count, never an
exception; the log says it once however often it repeats; nothing partial is left.
"""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from ds4_vllm.kvc.constants import TMP_MARKER
from ds4_vllm.store import CheckpointStore, CheckpointWriter, LoadReport
from ds4_vllm.store.fs import BUDGET_LOCK_NAME
from tests.store.store_helpers import WIDE, header, opts, payload, text_of, toks

pytestmark = pytest.mark.reliability


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture()
def tmpfs(tmp_path):
    path = tmp_path / "tmpfs"
    path.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(path)):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield path
    _mount("-o", "remount,rw", str(path))
    subprocess.run(["umount", "--lazy", str(path)], capture_output=True)  # detach even if a handle lingers


def warnings_of(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def filling_payload(tokens: list[int], filler) -> object:
    """A payload whose third layer is produced only after `filler()` took the free space."""
    p = payload(tokens, dims=WIDE, seed=len(tokens))
    layers = list(p.layers)

    def layer(i: int):
        if i == 2:
            filler()
        return layers[i]

    return type(p)(p.header, p.tokens, p.logits, p.n_comp, p.n_index_comp, layer)


def test_disk_fills_mid_write(tmpfs, caplog):
    store = CheckpointStore(opts(tmpfs), model_dims=WIDE, fsync=False).open()
    filler = tmpfs / "filler.bin"  # a non-checkpoint file in the directory: the store ignores it

    def fill() -> None:
        with open(filler, "wb") as f:
            free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
            f.write(b"\0" * free)  # tmpfs counts written pages only

    with caplog.at_level(logging.DEBUG, logger="ds4_vllm"):
        for n in range(3):
            tokens = toks(40 + n, start=5 * n)
            result = store.store(text_of(tokens), header(len(tokens)), filling_payload(tokens, fill))
            assert not result.stored and result.reason == "disk full (ENOSPC)", result
            assert [p.name for p in tmpfs.iterdir() if TMP_MARKER in p.name] == []
            assert list(tmpfs.glob("*.kv")) == []
            filler.unlink()
    assert len(warnings_of(caplog, "kv cache store failed")) == 1
    tokens = toks(50)
    result = store.store(text_of(tokens), header(50), payload(tokens, dims=WIDE, seed=50))
    assert result.stored, result.reason
    outcome = store.lookup(text_of(tokens + [1]), tokens + [1], None, 2)
    with CheckpointWriter(store.fs, WIDE).open_verified(outcome) as ck:
        assert [int(t) for t in ck.payload.tokens] == tokens


def test_directory_turns_read_only_while_serving(tmpfs, caplog):
    store = CheckpointStore(opts(tmpfs, disk_space_mb=1), model_dims=WIDE, fsync=False).open()
    stored = []
    for n in range(4):  # four ~200 KB files: the 1 MiB budget is full
        tokens = toks(40 + n, start=9 * n)
        assert store.store(text_of(tokens), header(len(tokens)), payload(tokens, dims=WIDE, seed=n)).stored
        stored.append(tokens)
    assert _mount("-o", "remount,ro", str(tmpfs))
    writer = CheckpointWriter(store.fs, WIDE)
    with caplog.at_level(logging.DEBUG, logger="ds4_vllm"):
        for tokens in stored:  # loads still work; the hit count is lost quietly
            prompt = tokens + [3]
            outcome = store.lookup(text_of(prompt), prompt, None, 2)
            assert outcome.hit
            with writer.open_verified(outcome) as ck:
                assert [int(t) for t in ck.payload.tokens] == tokens
            store.finish_load(outcome, LoadReport(outcome.path, True))
        for n in range(3):  # saves need eviction, which the read-only directory refuses
            tokens = toks(45, start=31 + n)
            result = store.store(text_of(tokens), header(45), payload(tokens, dims=WIDE, seed=9))
            assert not result.stored, result
    assert len(warnings_of(caplog, "kv cache evict failed")) == 1
    left = sorted(p.name for p in tmpfs.iterdir() if p.name != BUDGET_LOCK_NAME)
    assert left == sorted(p.name for p in tmpfs.glob("*.kv")), "no temp or reservation file is left"
    assert _mount("-o", "remount,rw", str(tmpfs))
    tokens = toks(45, start=31)
    assert store.store(text_of(tokens), header(45), payload(tokens, dims=WIDE, seed=9)).stored
