"""One function per fuzz target. Contract: a target returns normally for every input, both when
the input is valid and when the code under test rejects it with `KvcFormatError` (the documented
error of the kvc package). Any other exception, a failed invariant (AssertionError), a hang or a
crash of the process is a finding.

Targets:
    prefix      the 52-byte header + text length (`KvcHeader.unpack`, `unpack_prefix`, `read_prefix` rules)
    checkpoint  a whole file in memory (`parse_checkpoint`, strict and lenient trailer) and every view of it
    payload     the DSV4 payload alone (`parse_payload`), every section touched
    trailer     the KTM tool-id map alone (`parse_tool_map`, strict and lenient)
    scan        a checkpoint directory holding the fuzzed files (regular, misnamed, symlinked, temp)
                beside one good checkpoint: `CheckpointIndex.refresh`, `CheckpointStore.lookup`
                (which quarantines corrupt files) and `LocalFS.open`. Invariants: the good entry is
                always found and loaded, no entry is a link, nothing outside the store changes.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ds4_vllm.kvc import KvcFormatError, KvcHeader, parse_checkpoint
from ds4_vllm.kvc.header import unpack_prefix
from ds4_vllm.kvc.payload import Payload, parse_payload
from ds4_vllm.kvc.trailer import parse_tool_map

from .seeds import CTX, NANO, NOW, payload_data

#: Folder for a target's scratch files, made and removed by the process that runs the fuzzer.
SCRATCH_ENV = "DS4_VLLM_FUZZ_SCRATCH"


def scratch_base() -> str | None:
    """Memory-backed /dev/shm where writable (the scan target writes files per case), else the default."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


Target = Callable[[bytes], None]


def touch_payload(p: Payload) -> None:
    """Read the first and last element of every section: a view past the buffer would fault here."""
    assert len(p.layers) == p.header.n_layer == len(p.n_comp) == len(p.n_index_comp)
    arrays = [p.tokens, p.logits]
    for lay in p.layers:
        arrays += [a for a in (lay.raw, lay.comp, lay.state_kv, lay.state_score) if a is not None]
        arrays += [a for a in (lay.index_comp, lay.index_state_kv, lay.index_state_score) if a is not None]
    for arr in arrays:
        if arr.size:
            flat = arr.reshape(-1)
            float(flat[0]) + float(flat[-1])


def fuzz_prefix(data: bytes) -> None:
    try:
        header, text_bytes = unpack_prefix(data[:52], len(data))
    except KvcFormatError:
        return
    assert 52 + text_bytes + header.payload_bytes <= len(data)
    assert header.quant_bits in (2, 4) and header.tokens > 0
    header.reason_name, header.key_kind  # noqa: B018 - properties must not raise
    assert KvcHeader.unpack(header.pack()) == header  # every accepted header is writable again


def fuzz_checkpoint(data: bytes) -> None:
    for strict in (True, False):
        try:
            ck = parse_checkpoint(data, strict_trailer=strict)
        except KvcFormatError as exc:
            str(exc)
            continue
        with ck:
            touch_payload(ck.payload)
            assert (
                ck.payload_offset + ck.header.payload_bytes + ck.tool_map.nbytes + ck.trailing_bytes
                == len(data)
            )
            assert ck.trailing_bytes >= 0
            for entry in ck.tool_map.entries:
                assert 1 <= len(entry.tool_id) <= 256 and len(entry.dsml) >= 1
            ck.tool_map.ids  # noqa: B018


def fuzz_payload(data: bytes) -> None:
    try:
        p = parse_payload(data, 0, len(data))
    except KvcFormatError:
        return
    assert p.layout.total_bytes == len(data)
    touch_payload(p)


def fuzz_trailer(data: bytes) -> None:
    for strict in (True, False):
        try:
            tm = parse_tool_map(data, 0, len(data), strict=strict)
        except KvcFormatError:
            continue
        assert 0 <= tm.nbytes <= len(data)
        assert (
            sum(8 + len(e.tool_id) + len(e.dsml) for e in tm.entries) + (8 if tm.present else 0) == tm.nbytes
        )


# ---------------------------------------------------------------------------
# scan: a directory of hostile files beside a good one
# ---------------------------------------------------------------------------

#: Name kinds of a fuzzed file (selector byte % len).
NAME_KINDS = ("sha1", "upper", "other_hex", "not_hex", "symlink_out", "temp", "dir_symlink")
#: Selector bit: make `quarantine/` a link to a directory outside the store first.
QUARANTINE_LINK = 0x80
_RECORD = struct.Struct("<BH")


def scan_records(data: bytes) -> list[tuple[int, bytes]]:
    """Split a scan input into (selector, file bytes) records: [selector u8][length u16 LE][bytes]."""
    records, pos = [], 0
    while pos + _RECORD.size <= len(data) and len(records) < 4:
        selector, length = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        records.append((selector, data[pos : pos + length]))
        pos += length
    return records


def scan_input(records: list[tuple[int, bytes]]) -> bytes:
    return b"".join(_RECORD.pack(s, len(b)) + b for s, b in records)


def claimed_text_sha1(blob: bytes) -> str:
    """SHA-1 of the text the file's prefix claims (so kind "sha1" gets past the name check)."""
    if len(blob) >= 52:
        (n,) = struct.unpack_from("<I", blob, 48)
        return hashlib.sha1(blob[52 : 52 + n]).hexdigest()
    return hashlib.sha1(blob).hexdigest()


class ScanWorld:
    """A store directory with one good checkpoint, an outside directory, and a store on them."""

    def __init__(self) -> None:
        from ds4_vllm.kvc import write_checkpoint
        from ds4_vllm.store.checkpoint_store import CheckpointStore
        from ds4_vllm.store.options import StoreOptions

        self.root = Path(
            tempfile.mkdtemp(prefix="ds4-fuzz-scan-", dir=os.environ.get(SCRATCH_ENV) or scratch_base())
        )
        self.store_dir = self.root / "store"
        self.outside = self.root / "outside"
        self.outside.mkdir()
        self.good_tokens = [1, 2, 3, 0, 1, 2, 3, 0, 1]
        self.good_text = b"good checkpoint text"
        data = payload_data(NANO, len(self.good_tokens), 99)
        data.tokens = np.asarray(self.good_tokens, dtype=np.uint32)
        self.good = write_checkpoint(
            self.store_dir,
            self.good_text,
            KvcHeader.new(quant_bits=2, reason=1, tokens=len(self.good_tokens), ctx_size=CTX, now=NOW),
            data,
            fsync=False,
        )
        self.good_bytes = self.good.read_bytes()
        options = StoreOptions(
            disk_dir=str(self.store_dir), min_tokens=1, cold_max_tokens=0, disk_space_mb=64
        ).validate()
        self.store = CheckpointStore(
            options, model_dims=NANO, refresh_interval_s=0.0, fsync=False, clock=lambda: NOW + 60
        ).open()
        atexit.register(shutil.rmtree, self.root, ignore_errors=True)

    def reset(self) -> None:
        for entry in os.scandir(self.store_dir):
            if entry.path == str(self.good):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        shutil.rmtree(self.outside)
        self.outside.mkdir()

    def outside_state(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.outside.rglob("*")) if p.is_file()}

    def place(self, index: int, selector: int, blob: bytes) -> None:
        kind = NAME_KINDS[(selector & 0x7F) % len(NAME_KINDS)]
        sha = claimed_text_sha1(blob)
        name = {
            "sha1": f"{sha}.kv",
            "upper": f"{sha.upper()}.kv",
            "other_hex": f"{hashlib.sha1(blob + bytes([index])).hexdigest()}.kv",
            "not_hex": f"{sha[:39]}g.kv" if index % 2 else f"{sha}.kv.bak",
            "symlink_out": f"{sha}.kv",
            "temp": f"{sha}.kv.tmp.{index + 1}",
            "dir_symlink": f"{sha}.kv",
        }[kind]
        if sha == self.good.name[:40]:  # a second copy of the good text may rightly win its lookup
            return
        target = self.store_dir / name
        if target.exists() or target.is_symlink():
            return
        if kind == "symlink_out":
            (self.outside / f"file{index}.kv").write_bytes(blob)
            target.symlink_to(self.outside / f"file{index}.kv")
        elif kind == "dir_symlink":
            sub = self.outside / f"dir{index}"
            sub.mkdir()
            (sub / self.good.name).write_bytes(blob)
            target.symlink_to(sub, target_is_directory=True)
        else:
            target.write_bytes(blob)

    def run(self, data: bytes) -> None:
        from ds4_vllm.store.fs import QUARANTINE_DIR
        from ds4_vllm.store.local_fs import LocalFS
        from ds4_vllm.store.tool_memory import ToolMemory

        self.reset()
        records = scan_records(data)
        if any(s & QUARANTINE_LINK for s, _ in records):
            (self.outside / "q").mkdir()
            (self.store_dir / QUARANTINE_DIR).symlink_to(self.outside / "q", target_is_directory=True)
        for i, (selector, blob) in enumerate(records):
            self.place(i, selector, blob)
        before = self.outside_state()

        catalog = self.store._catalog
        catalog.refresh(force=True)
        entries = catalog.entries(refresh=False)
        paths = {str(e.path) for e in entries}
        assert str(self.good) in paths, f"good entry lost: {catalog._index.invalid}"
        for e in entries:
            assert not e.path.is_symlink() and e.path.parent == self.store_dir, e.path
        # Every listed entry either opens (and every view is readable) or is rejected as KvcFormatError.
        for e in entries:
            try:
                ck = self.store.fs.open(str(e.path))
            except KvcFormatError:
                continue
            with ck:
                touch_payload(ck.payload)
        # Lookups of every fuzzed text, then of the good text (which must hit the good file).
        for e in entries:
            if e.text is not None and e.path != self.good:
                self.store.lookup(e.text, [0] * min(e.tokens, 64), CTX, 2)
        # The tool-id memory reads the trailers of the same directory (links and odd names skipped).
        memory = ToolMemory(checkpoints=LocalFS(self.store_dir), max_bytes=1 << 16)
        memory.load_directory()
        assert memory.nbytes <= 1 << 16 or len(memory) == 1
        out = self.store.lookup(self.good_text, self.good_tokens, CTX, 2)
        assert out.hit and out.path == str(self.good), out
        assert self.good.read_bytes() == self.good_bytes
        assert self.outside_state() == before, "a file outside the store changed"


_world: ScanWorld | None = None


def fuzz_scan(data: bytes) -> None:
    global _world
    if _world is None:
        _world = ScanWorld()
    _world.run(data)


TARGETS: dict[str, Target] = {
    "prefix": fuzz_prefix,
    "checkpoint": fuzz_checkpoint,
    "payload": fuzz_payload,
    "trailer": fuzz_trailer,
    "scan": fuzz_scan,
}
