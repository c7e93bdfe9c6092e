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


def test_model_is_listed_as_ds4(client):
    assert [m.id for m in client.models.list().data] == ["ds4"]


def test_chat_completions(client):
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
    assert isinstance(choice.message.content, str)


def test_completions_are_deterministic(client):
    first = client.completions.create(model="ds4", prompt="The quick brown fox", max_tokens=6, temperature=0)
    second = client.completions.create(model="ds4", prompt="The quick brown fox", max_tokens=6, temperature=0)
    assert first.usage.completion_tokens == 6
    assert first.choices[0].text == second.choices[0].text
