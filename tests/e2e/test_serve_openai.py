"""Issue 2: `vllm serve --model ds4` answers the OpenAI client on both endpoints (real server process)."""

from __future__ import annotations

import pytest

from tests.e2e.server_process import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    proc = ServerProcess(["--model", "ds4", "--max-model-len", "4096"], log).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120)


def test_model_is_listed_as_ds4_with_the_engines_aliases(client):
    assert [m.id for m in client.models.list().data] == [
        "ds4",
        "deepseek-v4-flash",
        "deepseek-chat",
        "deepseek-reasoner",
    ]


def test_chat_completions(client):
    """Thinking is on by default (as in the engine): 8 tokens cut before `</think>` are reasoning."""
    reply = client.chat.completions.create(
        model="ds4",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 3
    assert choice.message.content is None
    assert isinstance(choice.message.reasoning, str) and choice.message.reasoning
    assert reply.usage.completion_tokens_details.reasoning_tokens == 8


def test_chat_completions_without_thinking_answer_in_content(client):
    reply = client.chat.completions.create(
        model="deepseek-chat",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert isinstance(reply.choices[0].message.content, str) and reply.choices[0].message.content
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_completions_are_deterministic(client):
    first = client.completions.create(model="ds4", prompt="The quick brown fox", max_tokens=6, temperature=0)
    second = client.completions.create(model="ds4", prompt="The quick brown fox", max_tokens=6, temperature=0)
    assert first.usage.completion_tokens == 6
    assert first.choices[0].text == second.choices[0].text
