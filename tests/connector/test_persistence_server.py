"""Issues 4 and 7: a checkpoint outlives the server process that wrote it, also on SIGTERM.

Server A (`vllm serve --model ds4 --kv-connector ds4disk`, as a user types it) computes a
long prompt, then streams a long completion of a second conversation and gets SIGTERM (what
`docker stop` and systemd send) after 300 streamed tokens: the running conversation's state
is saved with reason `shutdown`. Server B, a new process on the same `--kv-disk-dir`,
answers both conversations plus a new turn with the prefix loaded from disk (reported as
cached tokens) and the same output as a server without the connector.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import threading
import time

import pytest

from ds4_vllm.kvc import CheckpointIndex, open_checkpoint
from ds4_vllm.kvc.constants import TMP_MARKER
from tests.connector.server_runs import COMMON, MAX_TOKENS, answer_ids, complete
from tests.e2e.server_process import ServerProcess
from tests.model.engine_helpers import random_prompts

pytestmark = pytest.mark.slow

STREAMED_BEFORE_SIGTERM = 300


def wait_for_checkpoint(disk_dir, tokens: int, timeout: float = 60.0) -> None:
    index = CheckpointIndex(disk_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        index.refresh()
        if any(e.tokens == tokens for e in index.entries):
            return
        time.sleep(0.5)
    raise AssertionError(f"no {tokens}-token checkpoint appeared in {disk_dir}")


def stream_until_sigterm(server: ServerProcess, prompt: list[int]) -> tuple[int, int | None]:
    """Stream a long completion; SIGTERM the server after STREAMED_BEFORE_SIGTERM tokens.

    Returns (tokens streamed before the stream ended, the server's exit code).
    """
    import psutil
    from openai import OpenAI, Timeout

    # vLLM's API server waits for open connections before it exits, and a stream whose engine
    # was stopped never ends. The client hangs up once the engine core has exited (its shutdown
    # save done), as an agent would give up on a dead stream; the read timeout is the fallback.
    timeout = Timeout(300.0, read=60.0)  # the SDK's own type: openai 3 is built on httpx2
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=timeout, max_retries=0)
    streamed = 0
    stream = client.completions.create(
        model="ds4",
        prompt=prompt,
        max_tokens=4000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    hang_up = None
    try:
        for _ in stream:
            streamed += 1
            if streamed == STREAMED_BEFORE_SIGTERM:
                children = psutil.Process(server.proc.pid).children(recursive=True)
                engine = [c for c in children if "EngineCore" in " ".join(c.cmdline())]
                server.proc.send_signal(signal.SIGTERM)
                hang_up = threading.Thread(target=_hang_up_after, args=(stream, engine), daemon=True)
                hang_up.start()
    except Exception:  # the server goes away mid-stream; that is the point
        pass
    exit_code = server.proc.wait(timeout=120)
    if hang_up is not None:
        hang_up.join(timeout=5)
    return streamed, exit_code


def _hang_up_after(stream, processes) -> None:
    """Shut the stream's socket down once `processes` (the engine core) have exited."""

    if not processes:
        return  # not found: the read timeout ends the stream
    # A killed engine core stays a zombie until the API server reaps it, and the API server
    # first waits for this very connection: waiting for the pid to vanish would wait for the
    # read timeout (measured: 65 s). A zombie has exited.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(_alive(p) for p in processes):
        time.sleep(0.2)
    sock = stream.response.extensions["network_stream"].get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("persist")
    disk_dir = base / "kv"
    prompt, new_turn, running, running_turn = random_prompts([3000, 40, 2800, 30], seed=77)
    connector = ["--kv-connector", "ds4disk", "--kv-disk-dir", str(disk_dir)]

    server_a = ServerProcess(COMMON + connector, base / "a.log").start()
    try:
        first = complete(server_a, prompt)
        wait_for_checkpoint(disk_dir, len(prompt) + MAX_TOKENS - 1)
        streamed, exit_a = stream_until_sigterm(server_a, running)
    finally:
        server_a.stop()
    left_after_sigterm = sorted(p.name for p in disk_dir.iterdir() if TMP_MARKER in p.name)

    index = CheckpointIndex(disk_dir)
    index.refresh()
    saved, shutdown = None, []
    for entry in index.entries:
        with open_checkpoint(entry.path) as ck:
            tokens = [int(t) for t in ck.payload.tokens]
            if ck.header.reason_name == "evict" and tokens[: len(prompt)] == prompt:
                saved = tokens
            if ck.header.reason_name == "shutdown":
                shutdown.append(tokens)
    follow_up = prompt + answer_ids(first) + new_turn
    resumed = (shutdown[0] if shutdown else running) + running_turn

    trace = base / "trace.txt"
    server_b = ServerProcess(COMMON + connector + ["--trace", str(trace)], base / "b.log").start()
    try:
        restored = complete(server_b, follow_up)
        restored_shutdown = complete(server_b, resumed)
        metrics = _get(f"{server_b.base_url}/metrics")
    finally:
        server_b.stop()
    server_c = ServerProcess(COMMON, base / "c.log").start()
    try:
        cold = complete(server_c, follow_up)
        cold_shutdown = complete(server_c, resumed)
    finally:
        server_c.stop()
    return {
        "exit_a": exit_a,
        "log_a": (base / "a.log").read_text(errors="replace"),
        "log_b": (base / "b.log").read_text(errors="replace"),
        "left_after_sigterm": left_after_sigterm,
        "streamed": streamed,
        "saved": saved,
        "shutdown": shutdown,
        "running": running,
        "prompt": prompt,
        "first": first,
        "restored": restored,
        "restored_shutdown": restored_shutdown,
        "cold": cold,
        "cold_shutdown": cold_shutdown,
        "trace": trace.read_text(),
        "metrics": metrics,
    }


def _alive(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def _metric(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")]
    return sum(values)


def test_server_a_stops_gracefully_on_sigterm(runs):
    assert runs["streamed"] >= STREAMED_BEFORE_SIGTERM
    assert runs["exit_a"] == 0, runs["log_a"][-3000:]


def test_a_graceful_stop_leaves_no_temp_or_reservation_file(runs):
    """The shutdown save's reservation is released at stop, not left for the next start to clean."""
    assert runs["left_after_sigterm"] == []


def test_sigterm_saved_the_running_conversation_as_shutdown(runs):
    assert len(runs["shutdown"]) == 1, runs["log_a"][-3000:]
    tokens = runs["shutdown"][0]
    assert tokens[: len(runs["running"])] == runs["running"]
    # At least what had been streamed when the signal went out (the last streamed token not fed yet).
    assert len(tokens) >= len(runs["running"]) + STREAMED_BEFORE_SIGTERM - 1


def test_new_process_resumes_the_shutdown_checkpoint(runs):
    restored, cold = runs["restored_shutdown"], runs["cold_shutdown"]
    assert restored.usage.prompt_tokens_details.cached_tokens == len(runs["shutdown"][0])
    assert restored.choices[0].text == cold.choices[0].text


def test_checkpoint_holds_the_prompt_and_the_answer(runs):
    # The answer's last token was sampled but never fed, so the state ends one token before it.
    assert runs["saved"] == runs["prompt"] + answer_ids(runs["first"])[:-1]


def test_new_process_reports_the_prefix_as_cached(runs):
    details = runs["restored"].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == len(runs["saved"])


def test_same_output_as_without_the_connector(runs):
    assert runs["restored"].choices[0].text == runs["cold"].choices[0].text
    assert runs["cold"].usage.prompt_tokens_details.cached_tokens in (0, None)


def test_trace_explains_the_disk_hit(runs):
    block = runs["trace"]
    assert "cache_source: disk" in block
    assert f"disk_cached_tokens: {len(runs['saved'])}" in block
    assert "disk_cache_file: " in block


def test_prometheus_counts_the_hit(runs):
    text = runs["metrics"]
    assert _metric(text, "vllm:ds4disk_hits_total") >= 1
    assert _metric(text, "vllm:ds4disk_tokens_loaded_total") >= len(runs["saved"])
    assert _metric(text, "vllm:ds4disk_load_seconds_total") > 0


def test_the_hit_line_gives_the_workers_load_time(runs):
    """The scheduler's `kv cache hit` line carries the time the worker measured (it printed 0.0)."""
    hits = [float(m) for m in re.findall(r"kv cache hit tokens=\d+ .*? load=([0-9.]+) ms", runs["log_b"])]
    loaded = [
        float(m) for m in re.findall(r"kv cache loaded tokens=\d+ .*? load=([0-9.]+) ms", runs["log_b"])
    ]
    assert hits and sorted(hits) == sorted(loaded)
    assert all(ms > 0 for ms in hits)
