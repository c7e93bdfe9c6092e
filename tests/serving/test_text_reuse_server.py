"""Issue 9, text-keyed reuse: a follow-up turn reuses turn 1's sampled ids, in memory and after a restart.

A real `vllm serve --model ds4 --kv-connector ds4disk` and the openai SDK. The tiny random
model's greedy answers are arbitrary tokens; the two conversations below were chosen because
their answers are not the canonical tokenization of their text (each test re-tokenizes to
prove it), so a renderer that re-tokenized the whole follow-up prompt would diverge from the
computed state inside turn 1's answer and miss from there on.

Expected hit: turn 1's prompt + answer tokens minus one. The last sampled token was never fed
to the model, so no KV exists for it: the finished request's checkpoint holds P + A - 1 tokens
(`finished_save` with `num_computed_tokens`), and ds4disk restores at token granularity on top
of whatever whole 256-token blocks vLLM still holds, so the sum is exactly P + A - 1.
"""

from __future__ import annotations

import pytest

from ds4_vllm.chat.tokenizer import ASSISTANT, EOS, THINK_END, USER, default_tokenizer
from tests.e2e.server_process import ServerProcess

pytestmark = pytest.mark.slow

TOK = default_tokenizer()
COMMON = ["--model", "ds4", "--max-model-len", "4096", "--dtype", "float32"]
MAX_TOKENS = 24
NO_THINKING = {"thinking": {"type": "disabled"}}
#: Greedy answers of these turns are not canonical (found by trying "Story 0".."Story 5": 1 and 5).
CONVERSATIONS = {"plain": 1, "streamed": 5}
FOLLOW_UP = "Continue the story in one sentence."


def story(i: int) -> str:
    return f"Story {i}: " + " ".join(f"word{i}{j}" for j in range(40))


class Conversation:
    """Turn 1 and its follow-up on one server, with the ids the server reports."""

    def __init__(self, client, user: str) -> None:
        self.client = client
        self.user = user

    def turn1(self, *, stream: bool) -> dict:
        kwargs = {
            "model": "ds4",
            "messages": [{"role": "user", "content": self.user}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "extra_body": {"return_token_ids": True, **NO_THINKING},
        }
        if not stream:
            reply = self.client.chat.completions.create(**kwargs).model_dump()
            choice = reply["choices"][0]
            return {
                "prompt_ids": reply["prompt_token_ids"],
                "answer_ids": choice["token_ids"],
                "content": choice["message"]["content"],
                "finish_reason": choice["finish_reason"],
            }
        chunks = [c.model_dump() for c in self.client.chat.completions.create(stream=True, **kwargs)]
        prompt_ids = next(c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids"))
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        return {
            "prompt_ids": prompt_ids,
            "answer_ids": [t for ch in choices for t in ch.get("token_ids") or ()],
            "content": "".join(ch["delta"].get("content") or "" for ch in choices),
            "finish_reason": [ch["finish_reason"] for ch in choices if ch["finish_reason"]][-1],
        }

    def turn2(self, turn1: dict) -> dict:
        reply = self.client.chat.completions.create(
            model="ds4",
            messages=[
                {"role": "user", "content": self.user},
                {"role": "assistant", "content": turn1["content"]},
                {"role": "user", "content": FOLLOW_UP},
            ],
            max_tokens=2,
            temperature=0,
            extra_body={"return_token_ids": True, **NO_THINKING},
        ).model_dump()
        return {"prompt_ids": reply["prompt_token_ids"], "usage": reply["usage"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import openai

    base = tmp_path_factory.mktemp("text-reuse")
    args = [
        *COMMON,
        "--kv-connector",
        "ds4disk",
        "--kv-disk-dir",
        str(base / "kv"),
        "--kv-cache-min-tokens",
        "64",
    ]
    out: dict = {}
    server = ServerProcess(args, base / "a.log").start(timeout=600)  # 2 shared cores: starts take minutes
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)
        for name, seed in CONVERSATIONS.items():
            conv = Conversation(client, story(seed))
            first = conv.turn1(stream=name == "streamed")
            out[name] = {"turn1": first, "turn2": conv.turn2(first)}
    finally:
        server.stop()
    server = ServerProcess(args, base / "b.log").start(timeout=600)  # same directory, empty memory
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)
        for name, seed in CONVERSATIONS.items():
            out[name]["restart"] = Conversation(client, story(seed)).turn2(out[name]["turn1"])
    finally:
        server.stop()
    return out


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_turn1_answer_is_not_canonically_tokenized(run, name) -> None:
    turn1 = run[name]["turn1"]
    prompt, answer = turn1["prompt_ids"], turn1["answer_ids"]
    assert len(answer) == MAX_TOKENS and turn1["finish_reason"] == "length"
    assert TOK.decode_bytes(answer) == turn1["content"].encode()  # the client got the answer's exact text
    text = TOK.decode_bytes(prompt + answer).decode("utf-8")
    assert TOK.encode(text) != prompt + answer


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_turn2_prompt_is_turn1_ids_then_the_rest_tokenized(run, name) -> None:
    turn1, turn2 = run[name]["turn1"], run[name]["turn2"]
    computed = turn1["prompt_ids"] + turn1["answer_ids"]
    # turn 1 ended by length: the rendered history closes the answer with EOS
    rest = TOK.encode(EOS + USER + FOLLOW_UP + ASSISTANT + THINK_END)
    assert turn2["prompt_ids"] == computed + rest


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_turn2_hits_all_of_turn1_in_memory_and_after_a_restart(run, name) -> None:
    turn1 = run[name]["turn1"]
    expected_hit = len(turn1["prompt_ids"]) + len(turn1["answer_ids"]) - 1
    for key in ("turn2", "restart"):
        usage = run[name][key]["usage"]
        assert usage["prompt_tokens"] == len(run[name][key]["prompt_ids"])
        assert usage["prompt_cache_hit_tokens"] == expected_hit, key
        assert usage["prompt_cache_hit_tokens"] + usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"]
    restart = run[name]["restart"]
    assert restart["prompt_ids"] == run[name]["turn2"]["prompt_ids"]  # rebuilt from the checkpoint file
    assert restart["usage"]["prompt_cache_disk_tokens"] == expected_hit
