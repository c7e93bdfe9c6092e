"""Issue 9, agent loop: 20 turns of a coding agent through real `vllm serve --model ds4 --kv-connector
ds4disk` processes and the openai SDK, with a restart in the middle.

The agent has a stable system prompt and tools. Every turn the model calls a tool: the call is
forced (vLLM structured outputs, a regex matching one DSML block) with odd whitespace and a
non-schema argument order, so re-serializing the JSON arguments the client gets could never give
the sampled bytes back; some turns call two tools in one block. The client answers each call
with a tool result of a few KB. Two conversations run side by side on the same servers:

- `echo`: the client sends the calls back with `arguments` exactly as it received them;
- `reordered`: the client re-serializes the arguments in another key order (indented JSON).

Both only stay byte extensions of the cached state through exact replay by tool-call id.
After turn 10 the server is stopped with SIGINT and a new one starts on the same directory.
From turn 2 on, every turn must reuse at least 95% of its prompt (`prompt_cache_hit_tokens /
prompt_tokens`), the first turn after the restart included (its reuse can only come from disk),
and every response reports hit + miss = prompt tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.server_process import ServerProcess
from tests.serving.forced_dsml import forced

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

TURNS = 20
RESTART_AFTER = 10  # turns 1-10 on server A, 11-20 on server B
#: The issue's target: the DeepSeek API reaches about 0.95 on warm agent traffic.
MIN_HIT_RATIO = 0.95
#: The forced block is 250-480 bytes; the model may spell it in tokens of one byte (measured: the
#: two-call block of turn 15 ran past 400 tokens), so the limit is above its byte length.
MAX_TOKENS = 600
P_CLOSE = "</｜DSML｜parameter>"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read lines of a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "offset": {"type": "integer"},
                    "limit": {"type": "integer"},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "grep",
            "description": "Search the repository for a regular expression.",
            "parameters": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string"},
                    "paths": {"type": "array", "items": {"type": "string"}},
                    "ignore_case": {"type": "boolean"},
                },
                "required": ["pattern"],
            },
        },
    },
]

#: A stable system prompt of about 11,200 tokens: with the tools block turn 1's prompt is about
#: 11,600 tokens, so turn 2, which adds about 480 tokens of tool result, can reuse 95.9%.
SYSTEM = "You are a careful coding agent working in a large repository. Follow the rules below.\n" + "".join(
    f"Rule {i}: when you change module number {i}, keep its public interface stable, run the tests "
    "that cover it, and explain the change in one short paragraph.\n"
    for i in range(330)
)

_WORDS = (
    "cache state token layer buffer index offset render prompt request server engine window "
    "checkpoint restore compute value stream parser schema argument result module interface"
).split()


def tool_result(conversation: str, turn: int, call: int, calls: int) -> str:
    """About 2.2 KB of file text per turn (about 470 tokens: prose and code, tabs, a non-ASCII
    character), split between the calls of the turn; distinct per call."""
    rng = random.Random(f"{conversation}/{turn}/{call}")
    lines = [f"# {conversation} turn {turn} call {call}: résumé of the module"]
    for i in range(16 // calls):
        prose = " ".join(rng.choice(_WORDS) for _ in range(12))
        lines.append(f"# {prose}.")
        lines.append(f"\tdef {rng.choice(_WORDS)}_{i}(self, {rng.choice(_WORDS)}={i * turn}): return {i}")
    return "\n".join(lines)


def sampled_block(turn: int) -> str:
    """The DSML block turn `turn` is forced to sample: odd whitespace, arguments out of schema
    order, spaces around numbers; every fifth turn calls both tools in one block."""
    invokes = [
        f'<｜DSML｜invoke  name="read_file">\n'
        f'<｜DSML｜parameter name="limit" string="false">  {40 + turn} {P_CLOSE}\n'
        f'<｜DSML｜parameter name="path" string="true">src/mod_{turn}.py{P_CLOSE}\n'
        f'<｜DSML｜parameter name="offset" string="false">{turn * 10}{P_CLOSE}\n'
        "</｜DSML｜invoke>\n"
    ]
    if turn % 5 == 0:
        invokes.append(
            f'<｜DSML｜invoke name="grep" >\n'
            f'<｜DSML｜parameter name="ignore_case" string="false">true{P_CLOSE}\n'
            f'<｜DSML｜parameter name="paths" string="false">[ "src", "tests" ]{P_CLOSE}\n'
            f'<｜DSML｜parameter name="pattern" string="true">def  \\w+_{turn} &amp; x{P_CLOSE}\n'
            "</｜DSML｜invoke>\n"
        )
    return "\n\n<｜DSML｜tool_calls>\n" + "".join(invokes) + "</｜DSML｜tool_calls>"


def expected_arguments(turn: int) -> list[tuple[str, dict]]:
    calls = [("read_file", {"limit": 40 + turn, "path": f"src/mod_{turn}.py", "offset": turn * 10})]
    if turn % 5 == 0:
        calls.append(
            ("grep", {"ignore_case": True, "paths": ["src", "tests"], "pattern": f"def  \\w+_{turn} & x"})
        )
    return calls


@dataclass
class Turn:
    number: int
    server: str
    prompt: int
    hit: int
    miss: int
    disk: int
    calls: list[tuple[str, str, str]]  # (id, name, arguments) as the client received them
    disk_miss_reason: str = ""  # the connector's trace: why disk gave less than a file holds

    @property
    def ratio(self) -> float:
        return self.hit / self.prompt


@dataclass
class Conversation:
    name: str
    reorder: bool
    messages: list[dict] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Conversation {self.name}: review modules 1 to {TURNS}, one per turn.",
            },
        ]

    def ask(self, client, server: str, turn: int) -> None:
        """One agent turn: the forced tool call, then the client appends the call and its results."""
        response = client.chat.completions.create(
            model="ds4",
            messages=self.messages,
            tools=TOOLS,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=forced(sampled_block(turn)),
        )
        message, usage = response.choices[0].message, response.usage.model_dump()
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        self.turns.append(
            Turn(
                turn,
                server,
                usage["prompt_tokens"],
                usage["prompt_cache_hit_tokens"],
                usage["prompt_cache_miss_tokens"],
                usage["prompt_cache_disk_tokens"],
                calls,
            )
        )
        assert response.choices[0].finish_reason == "tool_calls", (self.name, turn, message)
        sent = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": self.client_arguments(arguments)},
            }
            for call_id, name, arguments in calls
        ]
        self.messages.append({"role": "assistant", "content": message.content, "tool_calls": sent})
        for i, (call_id, _, _) in enumerate(calls):
            self.messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": tool_result(self.name, turn, i, len(calls)),
                }
            )

    def client_arguments(self, arguments: str) -> str:
        if not self.reorder:
            return arguments
        return json.dumps(dict(reversed(json.loads(arguments).items())), indent=1)


def _serve(disk: Path, log: Path, trace: Path) -> ServerProcess:
    args = [
        "--model", "ds4", "--max-model-len", "32768",
        "--kv-connector", "ds4disk", "--kv-disk-dir", str(disk), "--trace", str(trace),
    ]  # fmt: skip
    return ServerProcess(args, log).start()


def trace_decisions(trace: Path) -> list[dict[str, str]]:
    """The `--trace` file's request blocks, in order: `key: value` fields of each."""
    blocks: list[dict[str, str]] = []
    for line in trace.read_text(encoding="utf-8").splitlines():
        if line.startswith("===== request "):
            blocks.append({})
        elif blocks and ": " in line and not line.startswith("---"):
            key, value = line.split(": ", 1)
            blocks[-1][key] = value
    return blocks


def run_on_one_server(
    runs: dict[str, Conversation], server_name: str, turns: range, disk: Path, base: Path
) -> None:
    """Turns `turns` of every conversation on one server process, then SIGINT; reads its trace."""
    from openai import OpenAI

    trace = base / f"trace-{server_name}.txt"
    server = _serve(disk, base / f"serve-{server_name}.log", trace)
    asked: list[Turn] = []
    try:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=600)
        for turn in turns:
            for conversation in runs.values():
                before = len(conversation.turns)
                try:
                    conversation.ask(client, server_name, turn)
                finally:
                    asked += conversation.turns[before:]
    finally:
        server.stop()  # SIGINT: vLLM drains, the connector flushes its saves
        decisions = trace_decisions(trace) if trace.exists() else []
        # one trace block per request, in the order sent (fewer when the server died)
        for t, decision in zip(asked, decisions, strict=False):
            t.disk_miss_reason = decision.get("disk_miss_reason", "")


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> dict[str, Conversation]:
    base = tmp_path_factory.mktemp("agent-loop")
    disk = base / "kv"
    runs = {"echo": Conversation("echo", reorder=False), "reordered": Conversation("reordered", reorder=True)}
    try:
        for server_name, turns in (
            ("A", range(1, RESTART_AFTER + 1)),
            ("B", range(RESTART_AFTER + 1, TURNS + 1)),
        ):
            run_on_one_server(runs, server_name, turns, disk, base)
    finally:  # the per-turn figures, also when a turn fails
        for conversation in runs.values():
            print(f"\n{conversation.name}: turn server prompt hit miss disk ratio disk_miss_reason")
            for t in conversation.turns:
                print(
                    f"  {t.number:2d} {t.server} {t.prompt:6d} {t.hit:6d} {t.miss:6d} {t.disk:6d}"
                    f" {t.ratio:.4f} {t.disk_miss_reason}"
                )
    return runs


@pytest.mark.parametrize("name", ["echo", "reordered"])
def test_every_turn_is_the_forced_tool_call(conversations, name) -> None:
    turns = conversations[name].turns
    assert [t.number for t in turns] == list(range(1, TURNS + 1))
    for t in turns:
        got = [(call_name, json.loads(arguments)) for _, call_name, arguments in t.calls]
        assert got == expected_arguments(t.number)
        assert all(i.startswith("call_") and len(i) == 37 for i, _, _ in t.calls)


@pytest.mark.parametrize("name", ["echo", "reordered"])
def test_hit_plus_miss_is_the_prompt_on_every_turn(conversations, name) -> None:
    for t in conversations[name].turns:
        assert t.hit + t.miss == t.prompt > 0, t
        assert 0 <= t.disk <= t.hit, t


@pytest.mark.parametrize("name", ["echo", "reordered"])
def test_every_turn_after_the_first_reuses_95_percent(conversations, name) -> None:
    turns = conversations[name].turns
    ratios = {t.number: (round(t.ratio, 4), t.disk_miss_reason) for t in turns[1:]}
    assert min(r for r, _ in ratios.values()) >= MIN_HIT_RATIO, ratios


@pytest.mark.parametrize("name", ["echo", "reordered"])
def test_the_first_turn_after_the_restart_reuses_from_disk(conversations, name) -> None:
    first_b = conversations[name].turns[RESTART_AFTER]
    assert first_b.server == "B"
    assert first_b.disk == first_b.hit  # server B started with an empty memory
    assert first_b.ratio >= MIN_HIT_RATIO, first_b
