"""Issue 12, load: a soak test on loopback with the openai SDK.

16 client threads each run agent-like conversations against a real
`vllm serve --model ds4 --kv-connector ds4disk` with a small disk budget (so eviction runs all
the time): a long system prompt and tool list, a user task, then turns of the model's answer
(greedy, 8 tokens), a client-made tool call and its result. The server is stopped with SIGTERM
and restarted on the same directory between segments of the run; conversations carry on across
the restarts. Afterwards every request of the run is sent again, as it was sent and with the same
concurrency, to a server without the connector (the reference): a wrong answer is then counted
once, not again in every later turn it would have changed. Expected:

- zero failed requests;
- zero wrong outputs: every answer equals the reference's answer to the same request;
- disk use (every file of the directory, sampled every 0.5 s) never above the budget plus the
  largest checkpoint file;
- memory flat: the summed RSS of every process of the server (API server and engine core) in the
  last quarter of each segment is within `RSS_GROWTH` of its second quarter.

DS4_VLLM_SOAK_REQUESTS sets the requests of each run (default 96; the full run of
scripts/reliability.sh sends more). The figures are printed and written to the JSON file named by
DS4_VLLM_SOAK_REPORT when set.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.reliability]

CLIENTS = 16
REQUESTS = int(os.environ.get("DS4_VLLM_SOAK_REQUESTS", "96"))
SEGMENTS = 3  # two restarts
TURNS_PER_CONVERSATION = 4
MAX_TOKENS = 8
#: A checkpoint of these conversations is 1.3-1.5 MB: 6 MiB holds four, so 16 clients evict all the time.
DISK_SPACE_MB = 6
SAMPLE_SECONDS = 0.5
#: A start takes 30-40 s on an idle machine; one took over 240 s at load average 83 (seen).
START_SECONDS = 900
#: Allowed RSS growth from a segment's second quarter to its last: see the docstring of
#: `test_memory_is_flat` for what was measured.
RSS_GROWTH = 0.10
COMMON = ["--model", "ds4", "--max-model-len", "4096", "--dtype", "float32"]
SYSTEM = "You are a coding agent working in a large repository. " * 20
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
    }
]


def call_id(client: int, conversation: int, turn: int) -> str:
    """A client-made id (the model seldom samples DSML): the same in both runs, unknown to the server."""
    return "call_" + hashlib.sha256(f"{client}/{conversation}/{turn}".encode()).hexdigest()[:32]


@dataclass
class Client:
    """One client's conversations: the next request follows from the answers so far."""

    number: int
    conversation: int = 0
    turn: int = 0
    messages: list = field(default_factory=list)

    def next_messages(self) -> list[dict]:
        if self.turn == 0:
            self.messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task {self.number}.{self.conversation}: fix the failing test."},
            ]
        return list(self.messages)

    def answered(self, content: str) -> None:
        tool_id = call_id(self.number, self.conversation, self.turn)
        self.messages += [
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": tool_id,
                        "type": "function",
                        "function": {"name": "run", "arguments": json.dumps({"cmd": f"step {self.turn}"})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": tool_id, "content": f"output of step {self.turn}: ok"},
        ]
        self.turn += 1
        if self.turn == TURNS_PER_CONVERSATION:
            self.conversation, self.turn = self.conversation + 1, 0


@dataclass
class Run:
    answers: dict = field(default_factory=dict)  # (client, request number) -> (content, finish reason)
    sent: dict = field(default_factory=dict)  # (client, request number) -> the messages sent
    failures: list = field(default_factory=list)
    samples: list = field(default_factory=list)  # (segment, seconds, disk bytes, largest file, rss bytes)
    requests: int = 0
    cache_hit_tokens: int = 0
    prompt_tokens: int = 0


def client_turns(
    base_url: str, client: Client, count: int, first: int, run: Run, lock: threading.Lock, script: dict | None
) -> None:
    """`count` requests of one client; from `script` ((client, n) -> messages) when given."""
    from openai import OpenAI

    api = OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=600)
    for n in range(first, first + count):
        if script is not None and (client.number, n) not in script:
            return  # the run being replayed stopped before this request
        messages = script[(client.number, n)] if script is not None else client.next_messages()
        try:
            response = api.chat.completions.create(
                model="ds4",
                messages=messages,
                tools=TOOLS,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"chat_template_kwargs": {"thinking": False}},
            )
        except Exception as exc:  # every failure is counted; the test asserts there are none
            with lock:
                run.failures.append((client.number, n, repr(exc)[:300]))
            return
        choice = response.choices[0]
        content = choice.message.content or ""
        usage = response.usage.model_dump() if response.usage else {}
        with lock:
            run.answers[(client.number, n)] = (content, choice.finish_reason)
            run.sent[(client.number, n)] = messages
            run.requests += 1
            run.prompt_tokens += usage.get("prompt_tokens", 0)
            run.cache_hit_tokens += usage.get("prompt_cache_hit_tokens", 0)
        client.answered(content)


def server_rss(server: ServerProcess) -> int:
    """Summed RSS of the `vllm serve` process and all its children (the engine core among them)."""
    import psutil

    total = 0
    try:
        root = psutil.Process(server.proc.pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def disk_use(directory: Path) -> tuple[int, int]:
    """(bytes of every file in the directory, the largest .kv file)."""
    total = largest = 0
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0, 0
    for entry in entries:
        try:
            size = entry.stat().st_size
        except FileNotFoundError:
            continue  # evicted between listing and stat
        total += size
        if entry.name.endswith(".kv"):
            largest = max(largest, size)
    return total, largest


def sampler(
    server: ServerProcess, directory: Path | None, segment: int, run: Run, stop: threading.Event
) -> None:
    started = time.monotonic()
    while not stop.wait(SAMPLE_SECONDS):
        disk, largest = disk_use(directory) if directory is not None else (0, 0)
        run.samples.append((segment, time.monotonic() - started, disk, largest, server_rss(server)))


def soak(
    args: list[str], log_dir: Path, directory: Path | None, restart: bool, script: dict | None = None
) -> Run:
    """Run every client's requests in SEGMENTS segments; restart the server between them if asked."""
    run, lock = Run(), threading.Lock()
    clients = [Client(i) for i in range(CLIENTS)]
    per_segment = max(1, -(-REQUESTS // (CLIENTS * SEGMENTS)))  # requests per client and segment
    server = ServerProcess(args, log_dir / "serve-0.log").start(timeout=START_SECONDS)
    try:
        for segment in range(SEGMENTS):
            if segment and restart:
                assert server.stop(signal_number=signal.SIGTERM) is not None
                server = ServerProcess(args, log_dir / f"serve-{segment}.log").start(timeout=START_SECONDS)
            stop = threading.Event()
            watcher = threading.Thread(
                target=sampler, args=(server, directory, segment, run, stop), daemon=True
            )
            watcher.start()
            with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
                futures = [
                    pool.submit(
                        client_turns,
                        server.base_url,
                        c,
                        per_segment,
                        segment * per_segment,
                        run,
                        lock,
                        script,
                    )
                    for c in clients
                ]
                for future in futures:
                    future.result()
            stop.set()
            watcher.join()
            if run.failures:
                break
    finally:
        server.stop(signal_number=signal.SIGTERM)
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("soak")
    directory = base / "kv"
    (base / "reference").mkdir()
    (base / "cached").mkdir()
    started = time.monotonic()
    cached_args = [
        *COMMON, "--kv-connector", "ds4disk", "--kv-disk-dir", str(directory),
        "--kv-disk-space-mb", str(DISK_SPACE_MB), "--kv-cache-min-tokens", "64",
    ]  # fmt: skip
    cached = soak(cached_args, base / "cached", directory, restart=True)
    reference = soak(COMMON, base / "reference", None, restart=False, script=cached.sent)
    report = figures(reference, cached, time.monotonic() - started)
    print(json.dumps(report, indent=1))
    if os.environ.get("DS4_VLLM_SOAK_REPORT"):
        Path(os.environ["DS4_VLLM_SOAK_REPORT"]).write_text(json.dumps(report, indent=1))
    return {"reference": reference, "cached": cached, "report": report, "logs": base}


def rss_growth(samples: list) -> list[float]:
    """Per segment: (median RSS of the last quarter - median of the second quarter) / second quarter."""
    out = []
    for segment in range(SEGMENTS):
        rss = [s[4] for s in samples if s[0] == segment and s[4] > 0]
        if len(rss) < 8:
            continue
        q = len(rss) // 4
        second, last = statistics.median(rss[q : 2 * q]), statistics.median(rss[3 * q :])
        out.append((last - second) / second)
    return out


def figures(reference: Run, cached: Run, seconds: float) -> dict:
    wrong = [k for k, v in cached.answers.items() if reference.answers.get(k) != v]
    return {
        "clients": CLIENTS,
        "segments (restarts + 1)": SEGMENTS,
        "requests reference": reference.requests,
        "requests cached": cached.requests,
        "failed": len(reference.failures) + len(cached.failures),
        "wrong outputs": len(wrong),
        "cache hit tokens / prompt tokens": f"{cached.cache_hit_tokens} / {cached.prompt_tokens}",
        "disk budget bytes": DISK_SPACE_MB << 20,
        "peak disk bytes": max((s[2] for s in cached.samples), default=0),
        "largest checkpoint bytes": max((s[3] for s in cached.samples), default=0),
        "peak server RSS bytes": max((s[4] for s in cached.samples), default=0),
        "RSS growth per segment (last vs second quarter)": [round(g, 4) for g in rss_growth(cached.samples)],
        "samples": len(cached.samples),
        "seconds": round(seconds),
    }


def test_no_request_fails(runs) -> None:
    assert runs["reference"].failures == [] and runs["cached"].failures == []
    assert runs["cached"].requests == runs["reference"].requests >= REQUESTS


def test_every_answer_equals_the_no_cache_answer(runs) -> None:
    reference, cached = runs["reference"].answers, runs["cached"].answers
    assert cached.keys() == reference.keys()
    wrong = {k: (cached[k], reference[k]) for k in cached if cached[k] != reference[k]}
    assert wrong == {}
    # The cache was used (from memory or disk), so equal answers say something.
    assert runs["cached"].cache_hit_tokens > 0


def test_disk_use_stays_within_the_budget_plus_one_file(runs) -> None:
    samples = runs["cached"].samples
    largest = max(s[3] for s in samples)
    assert largest > 0  # checkpoints were written
    over = [s for s in samples if s[2] > (DISK_SPACE_MB << 20) + largest]
    assert over == []
    # Eviction ran: the clients' checkpoints would not fit in the budget together.
    assert max(s[2] for s in samples) > (DISK_SPACE_MB << 20) // 2


def test_memory_is_flat(runs) -> None:
    """RSS_GROWTH (10%): in a short run (48 requests, 16 per segment, load average 40-90) the summed
    RSS of the API server, engine core and worker (peak 5.27 GB) moved by +0.0%, +5.3% and -4.5%
    from the second to the last quarter of the three segments: allocator noise, both ways. 10% is
    twice that noise; it catches growth of 500 MB per segment. The full run recorded in
    docs/reliability/http.md (DS4_VLLM_SOAK_REQUESTS=960: 320 requests per segment) moved by -0.26%,
    +0.62% and +0.26%, which bounds a per-request leak at about 0.2 MB."""
    growth = rss_growth(runs["cached"].samples)
    assert growth, "too few RSS samples"
    assert all(g < RSS_GROWTH for g in growth), growth
