"""Issue 20: a server flag for clients that read an absent `thinking` as Anthropic does (off).

`ds4-vllm serve --default-chat-template-kwargs '{"ds4_messages_thinking": false}'` (vLLM's own
flag, a ds4 key): an Anthropic SDK request without `thinking` is answered without thinking (its
cut answer is a text block, not a thinking block); `deepseek-reasoner` still thinks. That the
body's own `thinking` still wins is tests/serving/test_serving_glue.py's.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import httpx2
    from anthropic import Anthropic

    log = tmp_path_factory.mktemp("thinking-default") / "serve.log"
    args = ["--model", "ds4", "--max-model-len", "4096"]
    args += ["--default-chat-template-kwargs", json.dumps({"ds4_messages_thinking": False})]
    server = ServerProcess(args, log).start()
    try:
        yield Anthropic(base_url=server.base_url, api_key="unused", http_client=httpx2.Client(timeout=300))
    finally:
        server.stop()


@pytest.mark.parametrize(("model", "block"), [("ds4", "text"), ("deepseek-reasoner", "thinking")])
def test_an_absent_thinking_field_means_none(client, model: str, block: str) -> None:
    message = client.messages.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}], extra_body={"temperature": 0}
    )
    assert message.stop_reason == "max_tokens"
    assert [b.type for b in message.content] == [block]
