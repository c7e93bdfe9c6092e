"""Issue 4: a checkpoint outlives the server process that wrote it.

Server A computes a long prompt and is stopped gracefully (SIGINT). Server B, a new
process on the same `--kv-disk-dir`, answers the same conversation plus a new turn
with the prefix loaded from disk (reported as cached tokens) and the same output as
a server without the connector.
"""

from __future__ import annotations

import time

import pytest

from ds4_vllm.kvc import CheckpointIndex, open_checkpoint
from tests.e2e.server_process import ServerProcess
from tests.model.engine_helpers import random_prompts

pytestmark = pytest.mark.slow

COMMON = ["--model", "ds4", "--max-model-len", "8192", "--dtype", "float32", "--enable-prompt-tokens-details"]
MAX_TOKENS = 8


def complete(server: ServerProcess, prompt: list[int]):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)
    return client.completions.create(
        model="ds4",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )


def answer_ids(completion) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]


def wait_for_checkpoint(disk_dir, tokens: int, timeout: float = 60.0) -> None:
    index = CheckpointIndex(disk_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        index.refresh()
        if any(e.tokens == tokens for e in index.entries):
            return
        time.sleep(0.5)
    raise AssertionError(f"no {tokens}-token checkpoint appeared in {disk_dir}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("persist")
    disk_dir = base / "kv"
    prompt, new_turn = random_prompts([3000, 40], seed=77)
    connector = ["--kv-connector", "ds4disk", "--kv-disk-dir", str(disk_dir)]

    server_a = ServerProcess(COMMON + connector, base / "a.log").start()
    try:
        first = complete(server_a, prompt)
        wait_for_checkpoint(disk_dir, len(prompt) + MAX_TOKENS - 1)
    finally:
        exit_a = server_a.stop()

    index = CheckpointIndex(disk_dir)
    index.refresh()
    with open_checkpoint(max(index.entries, key=lambda e: e.tokens).path) as ck:
        saved = [int(t) for t in ck.payload.tokens]
    follow_up = prompt + answer_ids(first) + new_turn

    trace = base / "trace.txt"
    server_b = ServerProcess(COMMON + connector + ["--trace", str(trace)], base / "b.log").start()
    try:
        restored = complete(server_b, follow_up)
        metrics = _get(f"{server_b.base_url}/metrics")
    finally:
        server_b.stop()
    server_c = ServerProcess(COMMON, base / "c.log").start()
    try:
        cold = complete(server_c, follow_up)
    finally:
        server_c.stop()
    return {
        "exit_a": exit_a,
        "saved": saved,
        "prompt": prompt,
        "first": first,
        "restored": restored,
        "cold": cold,
        "trace": trace.read_text(),
        "metrics": metrics,
    }


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def _metric(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")]
    return sum(values)


def test_server_a_stops_gracefully(runs):
    assert runs["exit_a"] == 0


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
