"""Issue 12: an object-store directory whose backend stops answering never takes the store down.

A real S3-compatible server (moto's, on loopback) holds the checkpoints, reached through s3fs
with a region other than us-east-1 (s3fs handles that one differently). While it is stopped,
lookups are misses and saves are skipped, each call fails at once instead of waiting on the
network again, and the log says once what happened; when it answers again, so does the store.
Before the fix, s3fs's botocore `EndpointConnectionError` (not an OSError) escaped `lookup`,
which the connector calls on the engine loop.
"""

from __future__ import annotations

import contextlib
import logging
import time

import pytest

from ds4_vllm.store import CheckpointStore, CheckpointWriter
from ds4_vllm.store.object_fs import FsspecFS
from ds4_vllm.store.records import LoadFailure
from tests.store.store_helpers import MICRO, header, opts, payload, text_of, toks

pytestmark = pytest.mark.reliability

REGION = "eu-west-2"


class MotoS3:
    """moto's S3 server on a fixed loopback port, so it can be stopped and started again."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
        self.server.start()


@pytest.fixture()
def s3(monkeypatch):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import s3fs

    server = MotoS3()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{server.host}:{server.port}")
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    with contextlib.suppress(FileExistsError):  # moto keeps its buckets for the whole process
        fs.mkdir("ds4-kv", region_name=REGION)
    yield server
    server.stop()
    s3fs.S3FileSystem.clear_instance_cache()


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_stopped_object_store_is_a_miss_logged_once_then_recovers(s3, caplog):
    store = CheckpointStore(opts("s3://ds4-kv/cache"), model_dims=MICRO, refresh_interval_s=0).open()
    assert isinstance(store.fs, FsspecFS)
    prompt = toks(60)
    stored = store.store(text_of(prompt[:32]), header(32), payload(prompt[:32]))
    assert stored.stored, stored.reason
    hit = store.lookup(text_of(prompt), prompt, None, 2)
    assert hit.hit and hit.agreed_tokens == 32

    s3.stop()
    with caplog.at_level(logging.DEBUG, logger="ds4_vllm"):
        # First call: the backend's own retries, then a miss on the last listing's files.
        first = store.lookup(text_of(prompt), prompt, None, 2)
        if first.hit:  # its tokens were cached: the load must then fail, never return other bytes
            with pytest.raises(LoadFailure, match="object store unavailable"):
                CheckpointWriter(store.fs, MICRO).open_verified(first)
        started = time.monotonic()
        for n in range(5):
            more = toks(40 + n, start=7 + 5 * n)
            assert not store.lookup(text_of(more), more, None, 2).hit  # no stored text is its prefix
            result = store.store(text_of(more[:36]), header(36), payload(more[:36]))
            assert not result.stored and "object store unavailable" in result.reason
        # Measured: 5 lookups + 5 saves return in ~0.01 s while the backend is marked down;
        # one call that goes to the network takes 6-9 s (s3fs retries), so 2 s separates them.
        assert time.monotonic() - started < 2.0
    outage = [m for m in warnings_of(caplog) if "object store" in m or "cannot list" in m]
    assert any("failed (" in m and "requests are computed" in m for m in outage), outage
    assert len(outage) == len(set(outage)), f"a warning repeated: {outage}"
    assert len(outage) <= 3, outage  # the outage, the listing, the skipped save: once each

    s3.restart()
    store.fs.fs.retry_now()  # instead of waiting BACKEND_RETRY_S
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ds4_vllm"):
        again = store.lookup(text_of(prompt), prompt, None, 2)
    assert again.hit and again.agreed_tokens == 32
    assert any("answers again" in m for m in warnings_of(caplog))
    with CheckpointWriter(store.fs, MICRO).open_verified(again) as ck:
        assert [int(t) for t in ck.payload.tokens] == prompt[:32]


def test_files_of_another_process_are_seen(s3):
    """Each server has its own s3fs client; a listing must not come from the client's cache."""
    import s3fs

    writer = CheckpointStore(opts("s3://ds4-kv/shared"), model_dims=MICRO, refresh_interval_s=0).open()
    reader = CheckpointStore(opts("s3://ds4-kv/shared"), model_dims=MICRO, refresh_interval_s=0).open()
    reader.fs.fs._fs = s3fs.S3FileSystem(skip_instance_cache=True)  # as in another process
    first, second = toks(60), toks(60, start=20)
    assert writer.store(text_of(first[:32]), header(32), payload(first[:32])).stored
    assert reader.lookup(text_of(first), first, None, 2).hit  # the reader has listed the directory
    assert writer.store(text_of(second[:32]), header(32), payload(second[:32])).stored
    outcome = reader.lookup(text_of(second), second, None, 2)
    assert outcome.hit and outcome.agreed_tokens == 32


def test_object_store_that_hangs_costs_one_deadline_then_fails_fast(s3, caplog):
    """The endpoint accepts connections and never answers (a hung proxy or server)."""
    import socket
    import threading

    store = CheckpointStore(opts("s3://ds4-kv/hang"), model_dims=MICRO, refresh_interval_s=0).open()
    prompt = toks(60)
    assert store.store(text_of(prompt[:32]), header(32), payload(prompt[:32])).stored
    s3.stop()
    listener = socket.create_server((s3.host, s3.port))
    accepted: list[socket.socket] = []
    threading.Thread(
        target=lambda: [accepted.append(listener.accept()[0]) for _ in range(64)], daemon=True
    ).start()
    store.fs.fs.call_timeout_s = 1.0  # the default is BACKEND_CALL_TIMEOUT_S (10 s)
    try:
        with caplog.at_level(logging.WARNING, logger="ds4_vllm"):
            started = time.monotonic()
            store.lookup(text_of(prompt), prompt, None, 2)
            first = time.monotonic() - started
            started = time.monotonic()
            for n in range(5):
                more = toks(40, start=7 + 5 * n)
                assert not store.lookup(text_of(more), more, None, 2).hit
                assert not store.store(text_of(more[:36]), header(36), payload(more[:36])).stored
            rest = time.monotonic() - started
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
    # Measured: the first lookup returns after its 1 s deadline (1.0-1.3 s); without the deadline
    # it waited for s3fs's retries of a 60 s read timeout. 5 s allows for a loaded machine.
    assert accepted and first < 5.0, first
    assert rest < 2.0, rest
    outage = [m for m in warnings_of(caplog) if "requests are computed" in m]
    assert len(outage) == 1, outage
    assert "Timeout" in outage[0], outage
