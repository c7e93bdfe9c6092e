"""Exact replay through real `vllm serve --kv-connector ds4disk` processes and the openai SDK.

The model is forced (vLLM structured outputs, a regex) to sample a DSML block with odd whitespace
and a non-schema argument order, so re-serializing the returned JSON arguments could never give
the sampled bytes back. The client then sends the call back with its arguments in yet another key
order, after a server restart. The next turn's prompt must still be a byte extension of the
checkpoint the first turn saved: the second turn's checkpoint text starts with the first turn's,
and both carry the call id in their KTM trailers.

The restart test is `heavy` (about 2 minutes: two server starts); CI runs the first one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4_vllm.kvc import open_checkpoint
from tests.e2e.server_process import ServerProcess
from tests.serving.forced_dsml import regex_for

pytestmark = pytest.mark.slow

P_CLOSE = "</｜DSML｜parameter>"
#: Sampled as is: blank line, two spaces in the invoke tag, `size` before `path`, spaces around 42.
SAMPLED_BLOCK = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke  name="write_file">\n'
    '<｜DSML｜parameter name="size" string="false">  42 ' + P_CLOSE + "\n"
    '<｜DSML｜parameter name="path" string="true">notes &amp; todo.txt' + P_CLOSE + "\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file of the given size.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "size": {"type": "integer"}},
                "required": ["path", "size"],
            },
        },
    }
]
SYSTEM = "You are a careful coding agent. " * 12


def _serve(disk: Path, log: Path) -> ServerProcess:
    args = [
        "--model", "ds4", "--max-model-len", "4096",
        "--kv-connector", "ds4disk", "--kv-disk-dir", str(disk), "--kv-cache-min-tokens", "16",
        "--enable-auto-tool-choice", "--tool-call-parser", "ds4", "--reasoning-parser", "ds4",
    ]  # fmt: skip
    return ServerProcess(args, log).start()


def _checkpoints(disk: Path) -> dict[Path, tuple[bytes, dict[str, bytes]]]:
    out = {}
    for path in disk.glob("*.kv"):
        with open_checkpoint(path) as ck:
            out[path] = (ck.text, {e.tool_id.decode(): e.dsml for e in ck.tool_map.entries})
    return out


def test_sampled_calls_get_ids_that_the_checkpoints_already_map(tmp_path: Path) -> None:
    """Streaming and whole answers: ids derived in the API server are the ids the engine core wrote
    into the finished checkpoints' KTM trailers, and a restarted server loads them."""
    from openai import OpenAI

    disk = tmp_path / "kv"
    forced = {
        "chat_template_kwargs": {"thinking": False},
        "structured_outputs": {"regex": regex_for(SAMPLED_BLOCK)},
    }
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write the notes file."}]
    server = _serve(disk, tmp_path / "serve-1.log")
    try:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)
        whole = client.chat.completions.create(
            model="ds4", messages=messages, tools=TOOLS, max_tokens=200, extra_body=forced
        )
        chunks = client.chat.completions.create(
            model="ds4", messages=messages[1:], tools=TOOLS, max_tokens=200, extra_body=forced, stream=True
        )
        streamed = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
    finally:
        server.stop()
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, call.function.arguments) == (
        "write_file",
        '{"size":42,"path":"notes & todo.txt"}',
    )
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == [
        (0, "write_file", call.function.arguments)
    ]
    assert streamed[0].id != call.id and all(
        i.startswith("call_") and len(i) == 37 for i in (call.id, streamed[0].id)
    )
    maps = [ids for _, ids in _checkpoints(disk).values() if ids]
    assert sorted(maps, key=str) == sorted(
        [{call.id: SAMPLED_BLOCK.encode()}, {streamed[0].id: SAMPLED_BLOCK.encode()}], key=str
    )

    server = _serve(disk, tmp_path / "serve-2.log")
    server.stop()
    assert f"tool memory: 2 tool-call ids loaded from {disk}" in server.log_path.read_text()


@pytest.mark.heavy
def test_replay_survives_a_restart_and_a_reordered_client(tmp_path: Path) -> None:
    from openai import OpenAI

    disk = tmp_path / "kv"
    no_thinking = {"thinking": {"type": "disabled"}, "chat_template_kwargs": {"thinking": False}}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write the notes file."}]

    server = _serve(disk, tmp_path / "serve-1.log")
    try:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)
        first = client.chat.completions.create(
            model="ds4",
            messages=messages,
            tools=TOOLS,
            max_tokens=200,
            extra_body={**no_thinking, "structured_outputs": {"regex": regex_for(SAMPLED_BLOCK)}},
        )
    finally:
        server.stop()
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "write_file",
        {"size": 42, "path": "notes & todo.txt"},
    )
    assert call.id.startswith("call_") and len(call.id) == 37

    saved = _checkpoints(disk)
    block = SAMPLED_BLOCK.encode()
    turn1 = [(text, ids) for text, ids in saved.values() if text.endswith(block)]
    assert turn1, f"no checkpoint ends with the sampled block: {[t[-80:] for t, _ in saved.values()]}"
    turn1_text, turn1_ids = turn1[0]
    assert turn1_ids == {call.id: block}  # the finished save already maps the id the client got

    # the client re-serializes the arguments in another key order and sends the result back
    reordered = json.dumps({"path": "notes & todo.txt", "size": 42}, indent=1)
    history = [
        *messages,
        {
            "role": "assistant",
            "content": first.choices[0].message.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "write_file", "arguments": reordered},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "written " + "ok " * 300},
    ]
    server = _serve(disk, tmp_path / "serve-2.log")  # a fresh process: only the directory remembers
    try:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300)
        second = client.chat.completions.create(
            model="ds4",
            messages=history,
            tools=TOOLS,
            max_tokens=20,
            extra_body={**no_thinking, "structured_outputs": {"regex": "done"}},
        )
    finally:
        server.stop()
    assert second.choices[0].message.content == "done"

    later = {p: v for p, v in _checkpoints(disk).items() if p not in saved}
    extensions = [
        ids for text, ids in later.values() if text.startswith(turn1_text) and len(text) > len(turn1_text)
    ]
    assert extensions, "the second turn's prompt is not a byte extension of the first turn's checkpoint"
    assert all(ids.get(call.id) == block for ids in extensions)  # and carries the id on
