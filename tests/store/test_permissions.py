"""Everything written under a checkpoint directory is private: directories 0700, files 0600.

The ds4 engine creates its cache directory 0700; a checkpoint holds a user's prompt text and
model state, so every file in it is 0600, whatever the umask (checked at 000, the most
permissive, and 022, the usual one). One test per way a file gets there, and a guard that fails
when a new file writer appears in ds4_vllm without being listed (and so tested) here.
"""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ds4_vllm.kvc import ToolMapEntry, rewrite_tool_map, touch_checkpoint
from ds4_vllm.serving.usage import CacheUsage
from ds4_vllm.serving.usage_counters import COUNTERS_FILE, LOCK_FILE, UsageCounters
from ds4_vllm.store import CheckpointWriter, LoadReport
from ds4_vllm.store.checkpoint_store import CheckpointStore
from ds4_vllm.store.fs import BUDGET_LOCK_NAME, LEASE_DIR, QUARANTINE_DIR
from ds4_vllm.store.leases import LeaseBook, marker_name
from ds4_vllm.store.local_fs import LocalFS
from ds4_vllm.store.model_identity import MODEL_MARKER
from ds4_vllm.store.trace import TraceWriter
from tests.store.store_helpers import NOW, header, opts, payload, put, text_of, toks

pytestmark = pytest.mark.reliability

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=[0o000, 0o022], ids=["umask000", "umask022"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """Permission bits of every path under `root` (links listed as themselves)."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in sorted(root.rglob("*"))}


def assert_private(root: Path) -> None:
    wrong = {
        name: oct(mode)
        for name, mode in modes(root).items()
        if mode != (0o700 if (root / name).is_dir() else 0o600)
    }
    assert not wrong, f"not private under {root}: {wrong}"


def open_store(directory: Path, **kw) -> CheckpointStore:
    return CheckpointStore(
        opts(directory, **kw), clock=lambda: NOW + 60, fsync=False, model_fingerprint="f" * 40
    ).open()


def test_store_creates_directory_marker_and_checkpoints_private(tmp_path: Path, umask: int) -> None:
    """`--kv-disk-dir` with missing parents; the model marker; checkpoints from the writer."""
    root = tmp_path / "cache"
    directory = root / "a" / "b"
    store = open_store(directory)
    result = store.store(text_of(toks(20)), header(20), payload(toks(20)), [ToolMapEntry(b"call_1", b"<x/>")])
    assert result.stored
    # The connector's worker path: a ticket admitted by the scheduler side, written by CheckpointWriter.
    admission = store.admit(text_of(toks(30)), toks(30), header(30), store.file_size(60, 4096))
    assert admission.ticket is not None
    reservations = [p.name for p in directory.iterdir() if ".kv.tmp." in p.name]
    assert len(reservations) == 1, "an admitted write reserves its bytes in a file other processes count"
    assert_private(root)
    report = CheckpointWriter(store.fs, None).write(
        admission.ticket, text_of(toks(30)), header(30), payload(toks(30))
    )
    store.finish_write(report)
    assert report.stored
    assert {p.name for p in directory.iterdir()} == {
        MODEL_MARKER,
        BUDGET_LOCK_NAME,
        Path(result.path).name,
        Path(report.path).name,
    }
    assert_private(root)


def test_in_place_rewrites_keep_files_private(tmp_path: Path, umask: int) -> None:
    """Hit touches and KTM trailer rewrites change bytes in place, never the mode."""
    store = open_store(tmp_path / "d")
    path = Path(store.store(text_of(toks(20)), header(20), payload(toks(20))).path)
    touch_checkpoint(path, now=NOW + 5)
    rewrite_tool_map(path, [ToolMapEntry(b"call_2", b"<y/>")], now=NOW + 6)
    out = store.lookup(text_of(toks(25)), toks(25), 4096, 2)
    store.finish_load(out, LoadReport(out.path, True))  # the store's own touch
    assert_private(tmp_path / "d")


def test_quarantine_folder_and_its_files_are_private(tmp_path: Path, umask: int) -> None:
    store_dir = tmp_path / "d"
    store = open_store(store_dir)
    bad = put(store_dir, toks(20))
    with open(bad, "r+b") as fp:  # corrupt the payload magic: the lookup quarantines the file
        fp.seek(52 + len(text_of(toks(20))))
        fp.write(b"XXXX")
    assert not store.lookup(text_of(toks(25)), toks(25), 4096, 2).hit
    assert (store_dir / QUARANTINE_DIR / bad.name).exists()
    assert_private(store_dir)


def test_lease_markers_and_their_folder_are_private(tmp_path: Path, umask: int) -> None:
    """A load lease (issue 10) leaves an empty marker in `leases/` while the file is pinned."""
    store_dir = tmp_path / "d"
    open_store(store_dir)
    book = LeaseBook(LocalFS(store_dir), lease_s=600, clock=lambda: NOW, holder="h")
    name = "a" * 40 + ".kv"
    book.acquire(str(store_dir / name))
    assert [p.name for p in (store_dir / LEASE_DIR).iterdir()] == [marker_name(name, "h", NOW + 600)]
    assert_private(store_dir)


def test_usage_counters_and_their_lock_are_private(tmp_path: Path, umask: int) -> None:
    store_dir = tmp_path / "d"
    counters = UsageCounters(store_dir)  # creates the directory itself when the store has not
    counters.add(CacheUsage.of(100, 60, 10))
    counters.add(CacheUsage.of(50, 0, 0))
    assert {p.name for p in store_dir.iterdir()} == {COUNTERS_FILE, LOCK_FILE}
    assert counters.totals().requests == 2
    assert_private(store_dir)


def test_trace_file_is_private(tmp_path: Path, umask: int) -> None:
    """`--kv-cache-trace` may point into the directory; the trace quotes prompt text."""
    store_dir = tmp_path / "d"
    open_store(store_dir)
    with TraceWriter(str(store_dir / "trace.txt")) as trace:
        trace.event("hello")
    assert "hello" in (store_dir / "trace.txt").read_text()
    assert_private(store_dir)


def test_ds4_kv_cli_writes_nothing_and_keeps_modes(tmp_path: Path, umask: int) -> None:
    """The CLI commands that change a directory (`gc`, `rm`) only delete: what stays is still private."""
    store_dir = tmp_path / "d"
    store = open_store(store_dir)
    files = [
        Path(store.store(text_of(toks(n)), header(n), payload(toks(n), seed=n)).path) for n in (10, 20, 30)
    ]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}
    for args in (["rm", str(files[-1])], ["gc", str(store_dir), "--max-mb", "0.005"]):
        proc = subprocess.run(
            [sys.executable, "-m", "ds4_vllm.cli.kv", *args], capture_output=True, env=env, timeout=120
        )
        assert proc.returncode == 0, proc.stderr.decode()
    left = {p.name for p in store_dir.iterdir()}
    assert MODEL_MARKER in left and len(left) < len(files) + 1
    assert_private(store_dir)


# ---------------------------------------------------------------------------
# The guard: every call in ds4_vllm that can create a file or directory is listed here.
# ---------------------------------------------------------------------------

#: (module, function) -> why its files are covered (a test above) or not under the checkpoint directory.
KNOWN_WRITERS = {
    ("ds4_vllm/kvc/file.py", "ensure_directory"): "0700 directories: test_store_creates_...",
    (
        "ds4_vllm/kvc/atomic.py",
        "atomic_output",
    ): "mkdir of a temp directory beside the caller's target (model files)",
    ("ds4_vllm/kvc/file.py", "write_checkpoint"): "checkpoints 0600: test_store_creates_...",
    ("ds4_vllm/kvc/file.py", "open_regular_file"): "opens existing files (read or in place), never creates",
    ("ds4_vllm/kvc/file.py", "touch_checkpoint"): "in place, mode kept: test_in_place_rewrites_...",
    ("ds4_vllm/kvc/file.py", "rewrite_tool_map"): "in place, mode kept: test_in_place_rewrites_...",
    ("ds4_vllm/store/local_fs.py", "prepare"): "write probe 0600, removed at once",
    ("ds4_vllm/store/local_fs.py", "quarantine"): "0700 folder: test_quarantine_folder_...",
    (
        "ds4_vllm/store/fs.py",
        "write_private_file",
    ): "marker and counters 0600: test_store_..., test_usage_...",
    ("ds4_vllm/store/local_fs.py", "__enter__"): "budget lock 0600: test_store_creates_...",
    ("ds4_vllm/store/local_fs.py", "reserve"): "reservation files 0600: test_store_creates_...",
    (
        "ds4_vllm/store/local_fs.py",
        "put_marker",
    ): "lease markers 0600 in a 0700 folder: test_lease_markers_...",
    ("ds4_vllm/store/object_fs.py", "prepare"): "object store: a write probe object, removed at once",
    ("ds4_vllm/store/object_fs.py", "quarantine"): "object store: a move under quarantine/ (no local file)",
    ("ds4_vllm/store/object_fs.py", "write"): "fsspec staging in a private temporary directory, then upload",
    ("ds4_vllm/store/trace.py", "__init__"): "trace 0600: test_trace_file_is_private",
    ("ds4_vllm/serving/usage_counters.py", "__enter__"): "lock file 0600: test_usage_counters_...",
    (
        "ds4_vllm/serving/tokenizer.py",
        "ds4_tokenizer_of",
    ): "a private temporary directory, not the checkpoints",
    ("ds4_vllm/cli/kv.py", "main"): "opens /dev/null for writing",
}
#: Model and GGUF code writes model files (embedded tiny models), never under a checkpoint directory.
OTHER_AREAS = ("ds4_vllm/model/",)
_WRITING_ATTRS = {
    "write_bytes",
    "write_text",
    "mkdir",
    "makedirs",
    "mkstemp",
    "mkdtemp",
    "NamedTemporaryFile",
    "TemporaryDirectory",
}


def _writes(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name in _WRITING_ATTRS:
        return True
    if name == "open":
        mode = (
            node.args[1]
            if len(node.args) > 1
            else next((k.value for k in node.keywords if k.arg == "mode"), None)
        )
        flags = node.args[1] if len(node.args) > 1 else None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "os":
            text = ast.unparse(flags) if flags is not None else ""
            return not ("O_RDONLY" in text and not any(f in text for f in ("O_WRONLY", "O_RDWR", "O_CREAT")))
        return (
            isinstance(mode, ast.Constant)
            and isinstance(mode.value, str)
            and any(c in mode.value for c in "wax+")
        )
    return False


def test_every_file_writer_is_known() -> None:
    found = set()
    for path in sorted((REPO_ROOT / "ds4_vllm").rglob("*.py")):
        rel = str(path.relative_to(REPO_ROOT))
        if rel.startswith(OTHER_AREAS):
            continue
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                if any(isinstance(n, ast.Call) and _writes(n) for n in ast.walk(func)):
                    found.add((rel, func.name))
    unknown = found - set(KNOWN_WRITERS)
    assert not unknown, (
        f"new file writers: add a permission test and list them in KNOWN_WRITERS: {sorted(unknown)}"
    )
    gone = set(KNOWN_WRITERS) - found
    assert not gone, f"listed writers no longer write (update KNOWN_WRITERS): {sorted(gone)}"
