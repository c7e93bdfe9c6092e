"""Issue 10: several servers (Ray Serve replicas) on one store, a local directory or S3 (moto).

Each test plays the servers in this process with their own `CheckpointStore` and their own
filesystem object (for S3 a separate s3fs instance, so no listing cache is shared), as separate
replicas would have. What a user of a shared store relies on:
- a file one replica wrote is found by another within the documented rescan delay;
- writers of the same checkpoint racing each other leave one whole file, and a reader never
  parses a partial one;
- a writer killed in the middle of a write leaves nothing a lookup could choose;
- no replica evicts a file another replica is loading (its lease), until the lease ends.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ds4_vllm.kvc import KvcFormatError, ModelDims, text_sha1, write_checkpoint
from ds4_vllm.store import LoadReport
from ds4_vllm.store.checkpoint_store import CheckpointStore
from ds4_vllm.store.leases import parse_marker
from ds4_vllm.store.local_fs import LocalFS
from ds4_vllm.store.object_fs import FsspecFS
from tests.store.s3_server import moto_s3, new_bucket_url
from tests.store.store_helpers import NOW, WIDE, header, opts, payload, text_of, toks

pytestmark = pytest.mark.reliability


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    with moto_s3() as env:
        yield env


@pytest.fixture(params=["dir", "s3"])
def store_url(request, tmp_path: Path) -> str:
    """The shared store: a directory, or a fresh bucket on the loopback S3 server."""
    if request.param == "dir":
        return str(tmp_path / "shared")
    request.getfixturevalue("s3_env")
    return new_bucket_url()


def replica_fs(url: str):
    """One replica's own view of the store (no caches shared with the other replicas)."""
    if url.startswith("s3://"):
        return FsspecFS(url, skip_instance_cache=True)
    return LocalFS(url, fsync=False)


def replica(url: str, *, clock=lambda: NOW, **kw) -> CheckpointStore:
    return CheckpointStore(opts(url, **kw), clock=clock, fs=replica_fs(url), model_dims=None).open()


def lookup(store: CheckpointStore, tokens: list[int]):
    return store.lookup(text_of(tokens), tokens, 4096, 2)


def test_other_replicas_files_are_found_within_the_rescan_delay(store_url: str) -> None:
    writer = replica(store_url)
    reader = replica(store_url, rescan_ms=1500)
    prompt = toks(60)
    assert writer.store(text_of(prompt[:20]), header(20), payload(prompt[:20])).stored
    time.sleep(1.5)
    assert lookup(reader, prompt).agreed_tokens == 20  # the reader has listed the store once
    written = writer.store(text_of(prompt[:40]), header(40), payload(prompt[:40]))
    assert written.stored
    soon = lookup(reader, prompt)
    if store_url.startswith("s3://"):
        # No directory mtime on S3: the reader's listing is at most --kv-cache-rescan-ms old.
        assert soon.agreed_tokens == 20
        time.sleep(1.5)
    else:
        # A local directory's mtime changes with the rename: the next lookup re-reads it.
        assert soon.agreed_tokens == 40
    later = lookup(reader, prompt)
    assert later.hit and later.agreed_tokens == 40 and later.path == written.path


def test_a_replicas_own_write_is_found_by_its_next_lookup(store_url: str) -> None:
    """A request that waited for a write in flight (tensor parallel: only rank 0 holds the copy)
    looks it up right after it lands; an object store's listing interval must not hide it."""
    store = replica(store_url, rescan_ms=60_000)
    prompt = toks(60)
    assert store.store(text_of(prompt[:20]), header(20), payload(prompt[:20])).stored
    assert lookup(store, prompt).agreed_tokens == 20  # listed now; the next listing is 60 s away
    written = store.store(text_of(prompt[:40]), header(40), payload(prompt[:40]))
    found = lookup(store, prompt)
    assert found.hit and not found.in_flight and found.agreed_tokens == 40 and found.path == written.path


def _checkpoint_bytes(tmp: Path, tokens: list[int], seed: int) -> bytes:
    """One writer's version of the checkpoint: same text, payload values differing by seed."""
    folder = tmp / f"w{seed}"
    path = write_checkpoint(
        folder, text_of(tokens), header(len(tokens)), payload(tokens, seed=seed, dims=WIDE)
    )
    return path.read_bytes()


def test_racing_writers_leave_one_whole_file_and_readers_never_see_part(
    store_url: str, tmp_path: Path
) -> None:
    tokens = toks(48)
    versions = [_checkpoint_bytes(tmp_path, tokens, seed) for seed in range(4)]
    assert len(set(versions)) == 4 and all(len(v) == len(versions[0]) for v in versions)
    target = replica_fs(store_url)
    target.prepare()
    fs_path = target.path_of(text_sha1(text_of(tokens)))
    stop = threading.Event()
    reads: list[str] = []

    def write_many(seed: int) -> None:
        fs = replica_fs(store_url)
        for _ in range(6):
            fs.write(text_of(tokens), header(len(tokens)), payload(tokens, seed=seed, dims=WIDE), [])

    def read_while_writing() -> None:
        fs = replica_fs(store_url)
        while not stop.is_set():
            try:
                ck = fs.open(fs_path)
            except FileNotFoundError:
                reads.append("absent")
                continue
            except KvcFormatError as exc:  # a partial or mixed file would land here
                reads.append(f"torn: {exc}")
                continue
            with ck:
                reads.append("whole")

    writers = [threading.Thread(target=write_many, args=(seed,)) for seed in range(4)]
    reader = threading.Thread(target=read_while_writing)
    reader.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    fs = replica_fs(store_url)
    data = fs.fs.cat_file(fs_path) if isinstance(fs, FsspecFS) else Path(fs_path).read_bytes()
    assert data in versions, "the file is exactly one writer's checkpoint"
    assert "whole" in reads and not [r for r in reads if r.startswith("torn")], reads[:5]


#: ~12 MB: the S3 upload goes in several multipart parts (5 MiB parts, set below), and the
#: local write takes long enough to be killed in the middle.
HUGE = ModelDims(n_layer=5, head_dim=8, index_dim=4, n_vocab=3_000_000)
PART_BYTES = 5 * 1024 * 1024


def _write_huge(url: str, tokens: list[int], flag: str) -> None:
    """The dying writer; it stops for good at the worst moment and is killed there (a pause pins
    the kill instead of leaving it to timing). Locally: the temp file is complete, not yet
    renamed. On S3: after the first uploaded part (s3fs would upload 12 MB in one PUT, so 5 MiB
    parts make it a multipart upload)."""
    import functools

    fs = replica_fs(url)
    if isinstance(fs, LocalFS):

        def stall(*args, **kwargs):
            Path(flag).touch()
            time.sleep(3600)

        os.replace = stall
    else:
        s3 = fs.fs.wrapped  # the s3fs instance behind GuardedBackend
        s3.put_file = functools.partial(s3.put_file, chunksize=PART_BYTES)
        call = s3._call_s3

        async def call_then_stall(method, *args, **kwargs):
            out = await call(method, *args, **kwargs)
            if method == "upload_part":
                Path(flag).touch()
                time.sleep(3600)
            return out

        s3._call_s3 = call_then_stall
    fs.write(text_of(tokens), header(len(tokens)), payload(tokens, dims=HUGE), [])


def _write_started(url: str, flag: str) -> bool:
    """True once the child stalls with its bytes on their way: a temp file, or a part of the upload."""
    return os.path.exists(flag)


def test_writer_killed_mid_write_leaves_no_entry(store_url: str, tmp_path: Path) -> None:
    survivor = replica(store_url, rescan_ms=0)
    tokens = toks(40)
    flag = str(tmp_path / "part-uploaded")
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_write_huge, args=(store_url, tokens, flag))
    child.start()
    deadline = time.monotonic() + 120
    while not _write_started(store_url, flag):
        assert child.is_alive() and time.monotonic() < deadline, "the writer never started writing"
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL
    if store_url.startswith("s3://"):
        fs = FsspecFS(store_url, skip_instance_cache=True)
        uploads = fs.fs.list_multipart_uploads(fs.root.split("/")[0])
        assert len(uploads) == 1, "the killed upload is pending (a bucket lifecycle rule aborts it)"
    else:
        assert [n for n in os.listdir(store_url) if ".kv.tmp." in n], "the killed write left its temp file"
    assert survivor.entries() == []
    assert not lookup(survivor, toks(60)).hit
    # The surviving replica keeps writing and serving.
    assert survivor.store(text_of(tokens[:32]), header(32), payload(tokens[:32])).stored
    assert lookup(survivor, toks(60)).agreed_tokens == 32


def test_no_replica_evicts_a_file_another_is_loading(store_url: str) -> None:
    now = [NOW]
    clock = lambda: now[0]  # noqa: E731
    loader = replica(store_url, clock=clock, rescan_ms=0, disk_space_mb=1, lease_s=600)
    evictor = replica(store_url, clock=clock, rescan_ms=0, disk_space_mb=1, lease_s=600)
    # Files of ~200 KB: the 1 MiB budget holds four. The first one has the lowest score
    # (fewest tokens per byte), so eviction would take it first.
    convs = [toks(16, start=k * 7) for k in range(1)] + [toks(40, start=k * 7) for k in range(1, 8)]
    first = loader.store(text_of(convs[0]), header(16), payload(convs[0], dims=WIDE))
    assert first.stored
    out = lookup(loader, convs[0] + toks(10, start=50))
    assert out.hit and out.path == first.path
    loader.pin(out.path)  # the connector pins when the load is scheduled
    markers = [parse_marker(m) for m in loader.fs.list_markers()]
    assert markers == [(Path(first.path).name, loader._leases.holder, NOW + 600)]
    evicted: list[str] = []
    for tokens in convs[1:]:
        res = evictor.store(text_of(tokens), header(len(tokens)), payload(tokens, dims=WIDE))
        evicted += res.evicted
    assert evicted, "the budget forced evictions"
    assert first.path not in evicted and first.path in {str(e.path) for e in evictor.entries()}
    # The load ends; the lease goes with the last pin, and the file is fair game again.
    loader.finish_load(out, LoadReport(out.path, True))
    loader.unpin(out.path)
    assert loader.fs.list_markers() == []
    # (Even with its hit, 2 * 16 tokens per byte-size is still the lowest score: 40 for the rest.)
    more = toks(40, start=3)
    res = evictor.store(text_of(more), header(40), payload(more, dims=WIDE))
    assert res.evicted[0] == first.path


def test_a_dead_replicas_lease_expires(store_url: str) -> None:
    now = [NOW]
    clock = lambda: now[0]  # noqa: E731
    dead = replica(store_url, clock=clock, rescan_ms=0, lease_s=60)
    other = replica(store_url, clock=clock, rescan_ms=0, lease_s=60)
    small = dead.store(text_of(toks(16)), header(16), payload(toks(16), dims=WIDE))
    dead.pin(small.path)  # and never unpins: the replica died mid-load
    other.store(text_of(toks(40, start=9)), header(40), payload(toks(40, start=9), dims=WIDE))
    assert {str(e.path) for e in other.entries()} >= {small.path}
    # Over a budget that only the newer file fits: the leased file survives while the lease runs.
    tight = replica(store_url, clock=clock, rescan_ms=0, disk_space_mb=1, lease_s=60)
    for k in range(3):
        tight.store(text_of(toks(40, start=20 + k)), header(40), payload(toks(40, start=20 + k), dims=WIDE))
    assert small.path in {str(e.path) for e in tight.entries()}
    now[0] = NOW + 61
    more = toks(40, start=30)
    assert tight.store(text_of(more), header(40), payload(more, dims=WIDE)).evicted[0] == small.path
    assert tight.fs.list_markers() == [], "the expired marker is removed too"
