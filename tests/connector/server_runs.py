"""What the real-server persistence and fault tests share: the common flags, greedy completions
as token ids, no-cache reference answers and the ds4disk flags."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.server_process import ServerProcess

#: The flags of every server in these tests (float32: answers compared token for token).
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


def reference_answers(
    tmp_path: Path, prompts: list[list[int]], tails: list[list[int]], timeout: float
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(first answers, follow-up prompts, their answers) from a server without the connector.

    A follow-up is prompt + the reference's greedy answer + the tail, as an agent's next turn.
    """
    reference = ServerProcess(COMMON, tmp_path / "reference.log").start(timeout=timeout)
    try:
        firsts = [answer_ids(complete(reference, p)) for p in prompts]
        follow_ups = [p + f + t for p, f, t in zip(prompts, firsts, tails, strict=True)]
        expected = [answer_ids(complete(reference, f)) for f in follow_ups]
    finally:
        reference.stop()
    return firsts, follow_ups, expected


def ds4disk_flags(disk_dir: Path, budget_mb: int, kv_memory_bytes: int) -> list[str]:
    """`vllm serve` flags of a ds4disk server with a small disk budget and a small memory cache."""
    return [
        "--kv-connector",
        "ds4disk",
        "--kv-disk-dir",
        str(disk_dir),
        "--kv-disk-space-mb",
        str(budget_mb),
        "--kv-cache-memory-bytes",
        str(kv_memory_bytes),
    ]
