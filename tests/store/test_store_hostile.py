"""Hostile files in a checkpoint directory, at the level of the store (what a server does with them).

One directory holds a good checkpoint and, as longer prefixes of the same prompt (so lookups try
them first): every crafted lie of tests/fuzz/crafted.py, a file of another model shape, a
`<sha1>.kv` link to a valid file outside, a FIFO, a misnamed file and names that are not
40 hex digits. A lookup must still load the good entry, nothing outside the directory may be read
into a result or changed, and, under an address-space limit, nothing may allocate what the files
claim.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ds4_vllm.kvc import KvcHeader, SaveReason, ToolMapEntry, checkpoint_name, text_sha1, write_checkpoint
from ds4_vllm.kvc.constants import ExtFlag
from ds4_vllm.store import CheckpointWriter, LoadFailure
from ds4_vllm.store.checkpoint_store import CheckpointStore
from ds4_vllm.store.fs import QUARANTINE_DIR
from ds4_vllm.store.local_fs import LocalFS
from ds4_vllm.store.model_identity import MODEL_MARKER
from ds4_vllm.store.options import StoreConfigError, StoreOptions
from ds4_vllm.store.tool_memory import ToolMemory
from ds4_vllm.store.trailers import read_tool_map
from tests.fuzz.crafted import TOKENS, base_file, crafted_files
from tests.fuzz.seeds import CTX, NANO, NANO4, NOW, payload_data

pytestmark = pytest.mark.reliability

REPO_ROOT = Path(__file__).resolve().parents[2]
GOOD_TEXT = b"G" * 40
GOOD_TOKENS = [5, 6, 7, 8, 9, 10, 11, 12, 13]
PROMPT_TEXT = GOOD_TEXT + b"x" * 200
PROMPT_TOKENS = GOOD_TOKENS + [1] * 20


def write_nano(directory: Path, text: bytes, *, dims=NANO, tool_ids: tuple[str, ...] = ()) -> Path:
    data = payload_data(dims, TOKENS, 3)
    data.tokens = np.asarray(GOOD_TOKENS, dtype=np.uint32)
    header = KvcHeader.new(quant_bits=2, reason=SaveReason.COLD, tokens=TOKENS, ctx_size=CTX, now=NOW)
    tool_map = [ToolMapEntry(i.encode(), f"<invoke {i}/>".encode()) for i in tool_ids]
    return write_checkpoint(directory, text, header, data, tool_map, fsync=False)


def hostile_directory(root: Path, *, link_quarantine: bool = False) -> dict:
    """Build the directory described in the module docstring; returns what the checks need."""
    store_dir, outside = root / "store", root / "outside"
    store_dir.mkdir(mode=0o700)
    outside.mkdir()
    good = write_nano(store_dir, GOOD_TEXT, tool_ids=("call_good",))
    k = iter(range(1, 200))  # each hostile file claims a longer prefix of the prompt than the good one
    crafted = []
    for i in range(len(crafted_files(base_file(str(root))))):
        text = GOOD_TEXT + b"x" * next(k)
        case = crafted_files(base_file(str(root), text, GOOD_TOKENS))[i]
        path = store_dir / case.file_name
        if not path.exists():  # lies about the text length fall back to one shared name
            path.write_bytes(case.data)
            crafted.append(path)
    other_shape = write_nano(store_dir, GOOD_TEXT + b"x" * next(k), dims=NANO4)
    # A valid, right-shaped, token-matching file outside, reachable only through a link.
    link_text = GOOD_TEXT + b"x" * next(k)
    outside_file = write_nano(outside, link_text, tool_ids=("call_outside",))
    link = store_dir / outside_file.name
    link.symlink_to(outside_file)
    fifo = store_dir / checkpoint_name(GOOD_TEXT + b"x" * next(k))
    os.mkfifo(fifo)
    # Valid files under names the scan must not take: wrong SHA-1, not 40 hex digits.
    valid = write_nano(root, GOOD_TEXT + b"x" * next(k), tool_ids=("call_misnamed",)).read_bytes()
    misnamed = store_dir / (text_sha1(b"another text") + ".kv")
    not_hex = [store_dir / n for n in ("abc.kv", "g" * 40 + ".kv", "a" * 39 + ".kv", "a" * 41 + ".kv")]
    for p in [misnamed, *not_hex, store_dir / (text_sha1(GOOD_TEXT + b"x" * 999) + ".kv.bak")]:
        p.write_bytes(valid)
    if link_quarantine:
        (outside / "q").mkdir()
        (store_dir / QUARANTINE_DIR).symlink_to(outside / "q", target_is_directory=True)
    return {
        "store_dir": store_dir,
        "outside": outside,
        "good": good,
        "crafted": crafted,
        "other_shape": other_shape,
        "link": link,
        "fifo": fifo,
        "misnamed": misnamed,
    }


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def open_store(store_dir: Path) -> CheckpointStore:
    options = StoreOptions(
        disk_dir=str(store_dir), min_tokens=8, cold_max_tokens=0, disk_space_mb=64
    ).validate()
    return CheckpointStore(options, model_dims=NANO, fsync=False, clock=lambda: NOW + 60).open()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("link_quarantine", [False, True], ids=["quarantine_dir", "quarantine_is_a_link_out"])
def test_good_entry_is_loaded_through_a_directory_of_hostile_files(
    tmp_path: Path, link_quarantine: bool
) -> None:
    world = hostile_directory(tmp_path, link_quarantine=link_quarantine)
    store_dir, outside, good = world["store_dir"], world["outside"], world["good"]
    before_outside = snapshot(outside)
    assert len(world["crafted"]) >= 20

    store = open_store(store_dir)
    out = store.lookup(PROMPT_TEXT, PROMPT_TOKENS, CTX, 2)
    assert out.hit and out.path == str(good) and out.agreed_tokens == TOKENS, out
    with CheckpointWriter(store.fs, NANO).open_verified(out) as ck:
        assert ck.payload.tokens.tolist() == GOOD_TOKENS
    assert store.lookup(PROMPT_TEXT, PROMPT_TOKENS, CTX, 2).path == str(good)  # and again

    paths = {str(e.path) for e in store.entries()}
    for name in ("link", "fifo", "misnamed"):
        assert str(world[name]) not in paths, name
    invalid = store._catalog._index.invalid
    assert "symbolic link" in invalid[world["link"]] and "FIFO" in invalid[world["fifo"]]
    assert invalid[world["misnamed"]].startswith("file_name")
    assert world["other_shape"].exists()  # another model's file is left for its owner
    qdir = store_dir / QUARANTINE_DIR
    if link_quarantine:  # nothing moved out of the store through the link; the bad files stay put
        assert all(p.exists() for p in world["crafted"] if p.name not in invalid)
    else:
        moved = {p.name for p in qdir.iterdir()}
        corrupt_payloads = {p.name for p in world["crafted"] if p not in invalid and p.name not in paths}
        assert corrupt_payloads and corrupt_payloads <= moved
    assert snapshot(outside) == before_outside
    assert world["link"].is_symlink() and world["fifo"].exists()

    store.evict()  # eviction over the same directory neither crashes nor follows the link
    assert snapshot(outside) == before_outside

    memory = ToolMemory(checkpoints=LocalFS(store_dir))
    memory.load_directory()
    assert memory.lookup("call_good") == "<invoke call_good/>"
    assert memory.lookup("call_outside") is None  # not read through the link
    assert memory.lookup("call_misnamed") is None  # not a <sha1>.kv name


def test_worker_refuses_a_file_of_another_shape_swapped_in_after_the_lookup(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    good = write_nano(store_dir, GOOD_TEXT)
    store = open_store(store_dir)
    out = store.lookup(PROMPT_TEXT, PROMPT_TOKENS, CTX, 2)
    assert out.hit
    os.unlink(good)
    write_nano(store_dir, GOOD_TEXT, dims=NANO4)  # same text and tokens, another model's shape
    with pytest.raises(LoadFailure) as info:
        CheckpointWriter(store.fs, NANO).open_verified(out)
    assert "another model shape" in info.value.reason and not info.value.corrupt
    assert good.exists()  # not quarantined: it is a valid file of another model


@pytest.mark.parametrize("kind", ["link_out", "fifo", "huge"])
def test_hostile_model_marker_stops_startup_clearly(tmp_path: Path, kind: str) -> None:
    store_dir, outside = tmp_path / "store", tmp_path / "outside.json"
    store_dir.mkdir()
    marker = store_dir / MODEL_MARKER
    outside.write_text(json.dumps({"model_fingerprint": "f" * 40}))
    if kind == "link_out":
        marker.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(marker)
    else:
        with open(marker, "wb") as fp:  # sparse: no disk used
            fp.truncate(1 << 30)
    options = StoreOptions(
        disk_dir=str(store_dir), min_tokens=8, cold_max_tokens=0, disk_space_mb=64
    ).validate()
    tracemalloc.start()
    try:
        with pytest.raises(StoreConfigError) as info:
            CheckpointStore(options, fsync=False, model_fingerprint="a" * 40).open()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "--kv-disk-dir" in str(info.value) and MODEL_MARKER in str(info.value)
    assert {"link_out": "symbolic link", "fifo": "FIFO", "huge": "larger than"}[kind] in str(info.value)
    assert peak < 1 << 20, peak  # at most the 64 KiB a marker may have, never the 1 GiB file
    assert json.loads(outside.read_text()) == {"model_fingerprint": "f" * 40}


def test_tool_memory_copies_at_most_its_budget_from_a_huge_trailer(tmp_path: Path) -> None:
    """A genuine 64 MiB KTM entry (sparse file): a 1 MiB memory copies none of it."""
    path = write_nano(tmp_path, b"t")
    with open(path, "r+b") as fp:
        data = bytearray(fp.read())
        data[6] |= ExtFlag.TOOL_MAP
        fp.seek(0)
        fp.write(data[:48])
        fp.seek(len(data))
        fp.write(struct.pack("<3sBI", b"KTM", 1, 2) + struct.pack("<II", 4, 64 << 20) + b"call")
        fp.truncate(len(data) + 16 + 4 + (64 << 20))
    tracemalloc.start()
    try:
        assert read_tool_map(path, max_bytes=1 << 20) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


CHILD = r"""
import json, resource, sys
from pathlib import Path
import numpy as np
from ds4_vllm.kvc import KvcFormatError, open_checkpoint, parse_checkpoint, read_prefix, CheckpointIndex
from ds4_vllm.store import CheckpointWriter
from ds4_vllm.store.checkpoint_store import CheckpointStore
from ds4_vllm.store.local_fs import LocalFS
from ds4_vllm.store.options import StoreOptions
from ds4_vllm.store.tool_memory import ToolMemory
from tests.fuzz.seeds import NANO, NOW, CTX

store_dir = Path(sys.argv[1])
prompt_text, prompt_tokens = bytes.fromhex(sys.argv[2]), json.loads(sys.argv[3])
vm_kib = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:"))
headroom = 256 << 20
limit = vm_kib * 1024 + headroom
if sys.argv[4] == "limited":
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
rejected = 0
for p in sorted(store_dir.iterdir()):
    if not p.is_file() or p.is_symlink():
        continue
    for call in (lambda: open_checkpoint(p, check_name=False, follow_symlinks=False).close(),
                 lambda: read_prefix(p, follow_symlinks=False),
                 lambda: parse_checkpoint(p.read_bytes()).close()):
        try:
            call()
        except KvcFormatError:
            rejected += 1
index = CheckpointIndex(store_dir)
index.refresh()
options = StoreOptions(disk_dir=str(store_dir), min_tokens=8, cold_max_tokens=0, disk_space_mb=64).validate()
store = CheckpointStore(options, model_dims=NANO, fsync=False, clock=lambda: NOW + 60).open()
out = store.lookup(prompt_text, prompt_tokens, CTX, 2)
with CheckpointWriter(store.fs, NANO).open_verified(out) as ck:
    loaded = len(ck.payload.tokens)
ToolMemory(checkpoints=LocalFS(store_dir)).load_directory()
control = "not tried"
if sys.argv[4] == "limited":
    try:  # control: the limit bites, so the lines above really ran under it
        bytearray(headroom + (64 << 20))
        control = "allocated"
    except MemoryError:
        control = "MemoryError"
print(json.dumps({"rejected": rejected, "hit": out.hit, "path": out.path, "loaded": loaded, "control": control}))
"""


@pytest.mark.timeout(120)
def test_no_hostile_file_allocates_what_it_claims(tmp_path: Path) -> None:
    """The whole directory read, scanned, looked up and loaded under RLIMIT_AS = current + 256 MiB.

    The files claim up to 2^64 payload bytes, 16 GiB token arrays, 77 GB sections and 512 MiB KTM
    entries; one such allocation would raise MemoryError in the child (the control shows the
    limit bites).
    """
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    results = {}
    for mode in ("unlimited", "limited"):  # each on its own copy: lookups quarantine files
        (tmp_path / mode).mkdir()
        world = hostile_directory(tmp_path / mode)
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                str(world["store_dir"]),
                PROMPT_TEXT.hex(),
                json.dumps(PROMPT_TOKENS),
                mode,
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO_ROOT,
            timeout=100,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    limited, unlimited = results["limited"], results["unlimited"]
    assert limited["control"] == "MemoryError", limited
    assert limited["hit"] and limited["path"] == str(world["good"]) and limited["loaded"] == TOKENS, limited
    # Same rejections with and without the limit: none of them needed memory it could not have.
    n_crafted = len(world["crafted"])
    assert limited["rejected"] == unlimited["rejected"] >= 2 * n_crafted, (limited, n_crafted)
