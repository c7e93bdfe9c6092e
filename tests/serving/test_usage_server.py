"""Issue 9, usage part: real `vllm serve --model ds4 --kv-connector ds4disk` processes and the SDKs.

Every response of the four routes reports hit + miss = prompt tokens, streaming and
non-streaming usage agree, a repeated prompt hits (in memory, then from disk after a restart),
and `GET /v1/kv_cache` agrees with the directory's files and with the summed usage, across a
restart. No `--enable-prompt-tokens-details` anywhere: it is on by default. A server without
ds4disk reports its in-memory prefix-cache hits the same way.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from ds4_vllm.kvc import CheckpointIndex
from ds4_vllm.serving.usage_counters import COUNTERS_FILE
from tests.e2e.server_process import ServerProcess

pytestmark = pytest.mark.slow

COMMON = ["--model", "ds4", "--max-model-len", "4096", "--dtype", "float32"]
#: vLLM's prefix-cache block for the ds4 model (its log: "kv lcm block sizes 256"): a repeated
#: prompt finds at least all its full blocks in memory.
BLOCK = 256
MAX_TOKENS = 4
ROUTES = ("chat", "completions", "responses", "messages")


def long_text(seed: int) -> str:
    """About 600 prompt tokens of text no other test sends (no shared prefix beyond the template)."""
    return " ".join(f"w{seed}x{i}" for i in range(150))


class Usage(dict):
    """A response's usage, normalized: prompt, hit, miss, disk and the route's own cached field."""


def normalize(route: str, usage) -> Usage:
    u = usage.model_dump()
    hit, miss, disk = (
        u["prompt_cache_hit_tokens"],
        u["prompt_cache_miss_tokens"],
        u.get("prompt_cache_disk_tokens"),
    )
    if route in ("chat", "completions"):
        prompt, native = u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    elif route == "responses":
        prompt, native = u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    else:  # Anthropic: input = P - read - creation = 0 (the ds4 engine's meaning)
        assert u["input_tokens"] == 0
        assert u["cache_creation_input_tokens"] == miss
        prompt, native = (
            u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"],
            u["cache_read_input_tokens"],
        )
    return Usage(prompt=prompt, hit=hit, miss=miss, disk=disk, native_cached=native)


class Clients:
    def __init__(self, server: ServerProcess, ledger: list[Usage]) -> None:
        import anthropic
        import openai

        self.openai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)
        self.anthropic = anthropic.Anthropic(base_url=server.base_url, api_key="unused", timeout=300)
        self.server = server
        self.ledger = ledger  # every generation response, for the counters check

    def ask(self, route: str, text: str, *, stream: bool) -> Usage:
        usage = self._ask(route, text, stream)
        assert usage is not None, f"{route} (stream={stream}) sent no usage"
        result = normalize(route, usage)
        self.ledger.append(result)
        return result

    def _ask(self, route: str, text: str, stream: bool):
        messages = [{"role": "user", "content": text}]
        common = {"model": "ds4", "temperature": 0}
        if route == "chat":
            if not stream:
                return self.openai.chat.completions.create(
                    messages=messages, max_tokens=MAX_TOKENS, **common
                ).usage
            chunks = self.openai.chat.completions.create(
                messages=messages,
                max_tokens=MAX_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                **common,
            )
            return [c.usage for c in chunks if c.usage is not None][-1]
        if route == "completions":
            if not stream:
                return self.openai.completions.create(prompt=text, max_tokens=MAX_TOKENS, **common).usage
            chunks = self.openai.completions.create(
                prompt=text,
                max_tokens=MAX_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                **common,
            )
            return [c.usage for c in chunks if c.usage is not None][-1]
        if route == "responses":
            if not stream:
                return self.openai.responses.create(input=text, max_output_tokens=MAX_TOKENS, **common).usage
            events = self.openai.responses.create(
                input=text, max_output_tokens=MAX_TOKENS, stream=True, **common
            )
            return [
                e.response.usage for e in events if e.type in ("response.completed", "response.incomplete")
            ][-1]
        # This anthropic SDK takes no `temperature` argument: the body field goes in extra_body.
        anthropic_args = {"model": "ds4", "max_tokens": MAX_TOKENS, "extra_body": {"temperature": 0}}
        if not stream:
            return self.anthropic.messages.create(messages=messages, **anthropic_args).usage
        events = list(self.anthropic.messages.create(messages=messages, stream=True, **anthropic_args))
        start = [e.message.usage for e in events if e.type == "message_start"][0]
        assert start.cache_read_input_tokens is not None  # the hit is known from the first token on
        return [e.usage for e in events if e.type == "message_delta"][-1]

    def kv_cache(self) -> dict:
        with urllib.request.urlopen(f"{self.server.base_url}/v1/kv_cache", timeout=30) as r:
            return json.loads(r.read())


def settled_report(clients: Clients, disk_dir) -> tuple[dict, CheckpointIndex]:
    """The route's answer while the directory did not change around it (the writer is async)."""
    for _ in range(60):
        before = CheckpointIndex(disk_dir, keep_text=False)
        before.refresh()
        report = clients.kv_cache()
        after = CheckpointIndex(disk_dir, keep_text=False)
        after.refresh()
        if {e.path: e.file_size for e in before.entries} == {e.path: e.file_size for e in after.entries}:
            return report, after
        time.sleep(0.5)
    raise AssertionError(f"{disk_dir} kept changing for 30 s")


def assert_counters_match(report: dict, ledger: list[Usage]) -> None:
    assert report["requests"] == len(ledger)
    assert report["prompt_tokens"] == sum(u["prompt"] for u in ledger)
    assert report["prompt_cache_hit_tokens"] == sum(u["hit"] for u in ledger)
    assert report["prompt_cache_miss_tokens"] == sum(u["miss"] for u in ledger)
    assert report["prompt_cache_disk_tokens"] == sum(u["disk"] for u in ledger)
    hit, miss = report["prompt_cache_hit_tokens"], report["prompt_cache_miss_tokens"]
    assert report["hit_rate"] == pytest.approx(hit / (hit + miss), rel=1e-12)


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory):
    """Server A answers every route cold, warm and streamed; server B (same directory) after a restart."""
    base = tmp_path_factory.mktemp("usage")
    disk_dir = base / "kv"
    args = COMMON + [
        "--kv-connector",
        "ds4disk",
        "--kv-disk-dir",
        str(disk_dir),
        "--kv-cache-min-tokens",
        "64",
    ]
    ledger: list[Usage] = []
    run = {"disk_dir": disk_dir, "ledger": ledger}
    server_a = ServerProcess(args, base / "a.log").start()
    try:
        clients = Clients(server_a, ledger)
        for seed, route in enumerate(ROUTES):
            text = long_text(seed)
            run[route] = {
                "cold": clients.ask(route, text, stream=False),
                "warm": clients.ask(route, text, stream=False),
                "warm_stream": clients.ask(route, text, stream=True),
            }
        run["report_a"], run["index_a"] = settled_report(clients, disk_dir)
        run["ledger_a"] = list(ledger)
    finally:
        server_a.stop()
    server_b = ServerProcess(args, base / "b.log").start()
    try:
        clients = Clients(server_b, ledger)
        run["report_b_start"] = clients.kv_cache()
        run["after_restart"] = {
            route: clients.ask(route, long_text(seed), stream=True) for seed, route in enumerate(ROUTES)
        }
        run["report_b"], run["index_b"] = settled_report(clients, disk_dir)
        from openai import BadRequestError

        with pytest.raises(BadRequestError) as bad:
            clients.openai.chat.completions.create(
                model="ds4",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                stream_options={"include_usage": True},  # without stream=True
            )
        run["bad_stream_options"] = bad.value
        with pytest.raises(BadRequestError) as bad_type:
            clients.openai.chat.completions.create(
                model="ds4",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                stream=True,
                stream_options=5,
            )
        run["bad_stream_options_type"] = bad_type.value
        run["report_after_errors"] = clients.kv_cache()
    finally:
        server_b.stop()
    return run


@pytest.mark.parametrize("route", ROUTES)
def test_hit_plus_miss_is_the_prompt_on_every_response(disk_run, route) -> None:
    for usage in [*disk_run[route].values(), disk_run["after_restart"][route]]:
        assert usage["hit"] + usage["miss"] == usage["prompt"] > 0
        assert usage["native_cached"] == usage["hit"]
        assert 0 <= usage["disk"] <= usage["hit"]


@pytest.mark.parametrize("route", ROUTES)
def test_a_repeated_prompt_hits_and_streaming_agrees(disk_run, route) -> None:
    cold, warm, warm_stream = (disk_run[route][k] for k in ("cold", "warm", "warm_stream"))
    assert cold["hit"] == 0  # a prompt nobody sent before
    assert warm["prompt"] == cold["prompt"]
    assert warm["hit"] >= warm["prompt"] // BLOCK * BLOCK  # at least its full blocks, from memory
    assert warm_stream == warm


@pytest.mark.parametrize("route", ROUTES)
def test_after_a_restart_the_hit_comes_from_disk(disk_run, route) -> None:
    """Server B's memory is empty: every reused token was loaded from a checkpoint."""
    usage = disk_run["after_restart"][route]
    assert usage["hit"] > 0
    assert usage["disk"] == usage["hit"]
    assert usage["prompt"] == disk_run[route]["warm"]["prompt"]


def test_kv_cache_route_agrees_with_the_files_and_the_usage(disk_run) -> None:
    for report, index, ledger in (
        (disk_run["report_a"], disk_run["index_a"], disk_run["ledger_a"]),
        (disk_run["report_b"], disk_run["index_b"], disk_run["ledger"]),
    ):
        assert report["disk_cache"] is True and report["counters_persistent"] is True
        assert report["directory"] == str(disk_run["disk_dir"])
        assert report["entries"] == len(index.entries) > 0
        assert report["bytes_used"] == sum(e.file_size for e in index.entries)
        assert report["budget_bytes"] == 4096 << 20  # ds4's default --kv-disk-space-mb
        assert_counters_match(report, ledger)
    assert (disk_run["disk_dir"] / COUNTERS_FILE).is_file()


def test_counters_persist_across_a_restart(disk_run) -> None:
    before, after_start = disk_run["report_a"], disk_run["report_b_start"]
    keys = (
        "requests",
        "prompt_tokens",
        "prompt_cache_hit_tokens",
        "prompt_cache_miss_tokens",
        "prompt_cache_disk_tokens",
    )
    assert {k: after_start[k] for k in keys} == {k: before[k] for k in keys}


def test_invalid_stream_options_get_a_400_and_count_nothing(disk_run) -> None:
    assert disk_run["bad_stream_options"].status_code == 400
    assert "stream_options" in str(disk_run["bad_stream_options"])
    assert disk_run["bad_stream_options_type"].status_code == 400
    assert "stream_options" in str(disk_run["bad_stream_options_type"])
    assert disk_run["report_after_errors"]["requests"] == disk_run["report_b"]["requests"]


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory):
    """A server without ds4disk: vLLM's in-memory prefix cache only."""
    base = tmp_path_factory.mktemp("usage-memory")
    ledger: list[Usage] = []
    server = ServerProcess(COMMON, base / "c.log").start()
    try:
        clients = Clients(server, ledger)
        run = {
            route: [clients.ask(route, long_text(10 + seed), stream=s) for s in (False, True)]
            for seed, route in enumerate(ROUTES)
        }
        run["report"] = clients.kv_cache()
        run["ledger"] = ledger
    finally:
        server.stop()
    return run


@pytest.mark.heavy  # a second server, about 55 s; CI keeps the ds4disk server above
def test_without_ds4disk_memory_hits_are_reported_and_counted(memory_run) -> None:
    for route in ROUTES:
        cold, warm = memory_run[route]
        assert cold["hit"] == 0 and cold["hit"] + cold["miss"] == cold["prompt"]
        assert warm["hit"] >= warm["prompt"] // BLOCK * BLOCK > 0
        assert warm["hit"] + warm["miss"] == warm["prompt"]
        assert warm["disk"] == 0
    report = memory_run["report"]
    assert (report["disk_cache"], report["entries"], report["bytes_used"], report["counters_persistent"]) == (
        False,
        0,
        0,
        False,
    )
    assert_counters_match(report, memory_run["ledger"])
