"""Issue 21: after a restart, a turn whose previous answer re-renders differently from what the
model computed still reuses everything up to where that answer started.

A real `vllm serve --model ds4 --kv-connector ds4disk` and the openai SDK, thinking on (the
default). Every answer is cut by max_tokens inside its reasoning; the client sends each back as
the SDK returned it (empty content; the reasoning is not sent back), so the next prompt renders
`<｜Assistant｜></think><｜end▁of▁sentence｜>` where the model computed `<｜Assistant｜><think>...`.
The server is stopped (SIGINT) after the second turn and started again on the same directory;
what the user sees is the third turn's `cached_tokens`, against the second prompt's ids.
"""

from __future__ import annotations

import pytest

from tests.e2e.server_process import ServerProcess
from tests.serving.test_late_divergence_server import system_prompt

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

LISTING = "".join(f"src/module_{i}.py  {i * 137} bytes\n" for i in range(40))
QUESTIONS = [f"Here are the files:\n{LISTING}Which one is the largest?", "Open it.", "Summarise it."]


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rerender")


@pytest.fixture(scope="module")
def turns(work_dir) -> list[dict]:
    from openai import OpenAI

    tmp = work_dir
    args = [
        "--model", "ds4", "--max-model-len", "16384",
        "--kv-connector", "ds4disk", "--kv-disk-dir", str(tmp / "kv"), "--trace", str(tmp / "trace.txt"),
    ]  # fmt: skip
    messages: list[dict] = [{"role": "system", "content": system_prompt(380, "rerender/alpha")}]
    results = []
    server = ServerProcess(args, tmp / "serve-1.log").start()
    try:
        for i, question in enumerate(QUESTIONS):
            if i == 2:  # restart between the second and third turn
                server.stop()
                server = ServerProcess(args, tmp / "serve-2.log").start()
            client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=900)
            messages.append({"role": "user", "content": question})
            reply = client.chat.completions.create(
                model="ds4", messages=messages, max_tokens=12, extra_body={"return_token_ids": True}
            )
            choice = reply.choices[0]
            messages.append({"role": "assistant", "content": choice.message.content or ""})
            data = reply.model_dump()
            results.append(
                {
                    "prompt_ids": data["prompt_token_ids"],
                    "cached": data["usage"]["prompt_tokens_details"]["cached_tokens"],
                    "finish_reason": choice.finish_reason,
                    "content": choice.message.content,
                    "reasoning": data["choices"][0]["message"].get("reasoning")
                    or data["choices"][0]["message"].get("reasoning_content"),
                }
            )
    finally:
        server.stop()
    for i, r in enumerate(results):
        print(f"turn {i + 1}: prompt {len(r['prompt_ids'])}, cached {r['cached']}, {r['finish_reason']}")
    return results


def test_every_answer_was_cut_inside_its_reasoning(turns) -> None:
    for turn in turns:
        assert turn["finish_reason"] == "length"
        assert not turn["content"] and turn["reasoning"]


def test_the_next_prompt_renders_the_answer_differently(turns) -> None:
    """The second prompt shares the first one's ids up to `<｜Assistant｜>`, not its `<think>`."""
    first, second = turns[0]["prompt_ids"], turns[1]["prompt_ids"]
    assert second[: len(first) - 1] == first[:-1]
    assert second[len(first) - 1] != first[-1]


def test_after_the_restart_the_turn_reuses_up_to_where_the_previous_answer_started(turns) -> None:
    previous, third = turns[1]["prompt_ids"], turns[2]
    answer_start = len(previous) - 1
    assert third["prompt_ids"][:answer_start] == previous[:answer_start]
    assert third["cached"] == answer_start, (third["cached"], answer_start, len(third["prompt_ids"]))


def test_the_trace_names_the_answer_start_saves(turns, work_dir) -> None:
    trace = (work_dir / "trace.txt").read_text()
    saves = [line for line in trace.splitlines() if line.startswith("--- trace: save request=")]
    at = {int(line.split()[4].split("@")[1]) for line in saves if "evict(answer-start)@" in line}
    assert {len(turns[0]["prompt_ids"]) - 1, len(turns[1]["prompt_ids"]) - 1} <= at, saves
