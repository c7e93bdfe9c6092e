"""Seeded, replayable agent traffic for any OpenAI-compatible server (issue 11).

`plan_traffic(TrafficConfig)` is a pure function of the seed: the same list of `PlannedRequest`
every run. It holds several interleaved coding-agent conversations that share one stable system
prompt and tool schemas, a sub-agent that starts its own conversation and hands its result back
to its parent as a tool result, occasional one-off prompts, and a phase boundary where
`run_traffic` calls a restart callback (the server is stopped and a new one started).

The tiny random model never calls a tool, so the generator plays the agent's side: each turn's
history holds the assistant message the server actually sent (its greedy reply text, which the
server's text-keyed reuse maps back to the sampled ids) plus the tool calls the plan gives that
turn, then the tool results (a few hundred bytes to tens of KB). That is what a real agent's
history holds: the model's own output, its tool calls, their results. The plan fixes everything
but the replies; at temperature 0 on one model those are the same on every run and system.

Requests run in non-thinking mode (`chat_template_kwargs.thinking = false`), so the reply is
visible text. Every request streams (`stream_options.include_usage`): time to first token is measured at the
first chunk that carries text, decode tokens/s from the chunks after it, and the cache fields come
from the final usage chunk (`prompt_tokens_details.cached_tokens` and ds4's
`prompt_cache_hit_tokens` / `prompt_cache_miss_tokens` / `prompt_cache_disk_tokens`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

MODEL = "ds4"

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": [next(iter(properties))]},
        },
    }
    for name, description, properties in (
        (
            "read_file",
            "Read lines of a file of the repository.",
            {"path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": "integer"}},
        ),
        (
            "grep",
            "Search the repository for a regular expression.",
            {"pattern": {"type": "string"}, "paths": {"type": "array", "items": {"type": "string"}}},
        ),
        (
            "run_tests",
            "Run the test files given and return their output.",
            {"paths": {"type": "array", "items": {"type": "string"}}, "verbose": {"type": "boolean"}},
        ),
        (
            "spawn_agent",
            "Start a sub-agent on a task; returns its final report.",
            {"task": {"type": "string"}},
        ),
    )
]

_WORDS = (
    "cache state token layer buffer index offset render prompt request server engine window "
    "checkpoint restore compute value stream parser schema argument result module interface "
    "writer reader budget eviction queue thread signal config option socket header payload"
).split()


#: Where a session's own lines sit in its system prompt (the `folders` scenario): after this
#: share of the rules, as a coding agent puts its working directory late in its instructions.
FOLDER_DEPTH = 0.85


def system_prompt(rules: int, folder: str = "", status: str = "") -> str:
    """The agent's system prompt: `rules` numbered rules (about 34 tokens each); with `folder`,
    the session's working directory and `status` line late among them."""
    lines = [
        f"Rule {i}: when you change module number {i}, keep its public interface stable, run the tests "
        "that cover it, and explain the change in one short paragraph.\n"
        for i in range(rules)
    ]
    if folder:
        lines.insert(
            int(rules * FOLDER_DEPTH), f"Working directory: /home/user/projects/{folder}\nStatus: {status}\n"
        )
    return (
        "You are a careful coding agent working in a large repository. Follow the rules below.\n"
        + "".join(lines)
    )


def file_text(rng: random.Random, size: int, label: str) -> str:
    """About `size` bytes of source-like text (prose comments and code lines), distinct per `label`."""
    lines = [f"# {label}: résumé of the module"]
    total = len(lines[0])
    i = 0
    while total < size:
        prose = " ".join(rng.choice(_WORDS) for _ in range(10))
        code = f"\tdef {rng.choice(_WORDS)}_{i}(self, {rng.choice(_WORDS)}={rng.randrange(1000)}): return {i}"
        lines += [f"# {prose}.", code]
        total += len(prose) + len(code) + 5
        i += 1
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class TrafficConfig:
    """The shape of one run; every figure of the plan derives from these and the seed."""

    seed: int = 11
    conversations: int = 4
    # Each main conversation gets one turn per round. 24 turns, as long as the sessions of the
    # DeepSeek-API client in shared/notes (95.2 % warm hit rate over 24 turns): at 8 the new text
    # of a few large tool results caps any cache's hit rate near 0.95, whatever the seed.
    rounds: int = 24
    restart_after_round: int = 12  # the restart callback runs after this round (0: never)
    system_rules: int = 150  # about 5k tokens of system prompt + tools
    subagent_round: int = 2  # the round in which one conversation spawns its sub-agent (0: none)
    subagent_turns: int = 3
    one_off_every: int = 3  # a one-off prompt after every n-th round (0: none)
    small_result_bytes: tuple[int, int] = (150, 700)
    large_result_bytes: tuple[int, int] = (10_000, 20_000)
    large_result_every: int = 30  # every n-th tool result is large (a whole file, a test log)
    max_tokens: int = 16
    # The `folders` scenario (issue 21): each session works in its own folder, named late in its
    # system prompt; sessions start one round apart (new folders); in the restart's round one
    # session is retried in its folder with its status line changed (system text that moves).
    folders: bool = False


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]
    result: str


@dataclasses.dataclass(frozen=True)
class PlannedRequest:
    """One request of the plan: what the client appends to `conversation`'s history, then sends.

    `calls` are the tool calls of the assistant turn that answered the conversation's previous
    request (its text is the server's reply) and their results; `user` is a user message.
    """

    index: int
    phase: int  # 0 before the restart, 1 after
    conversation: str
    kind: str  # "main", "subagent" or "one-off"
    turn: int  # 1-based turn within its conversation
    user: str | None = None
    calls: tuple[ToolCall, ...] = ()
    system: bool = True  # one-off prompts have no agent system prompt
    folder: str = ""  # the `folders` scenario: the session's folder and status line
    status: str = ""

    @property
    def new_bytes(self) -> int:
        """Bytes of new client text (user message and tool results) this request adds."""
        return len((self.user or "").encode()) + sum(len(c.result.encode()) for c in self.calls)


class _Planner:
    def __init__(self, config: TrafficConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.requests: list[PlannedRequest] = []
        self.turns: dict[str, int] = {}
        self.call_count = 0

    def add(self, phase: int, conversation: str, kind: str, **fields: Any) -> None:
        turn = self.turns.get(conversation, 0) + 1
        self.turns[conversation] = turn
        self.requests.append(PlannedRequest(len(self.requests), phase, conversation, kind, turn, **fields))

    def result_size(self) -> int:
        lo, hi = self.config.small_result_bytes
        if self.config.large_result_every and self.call_count % self.config.large_result_every == 0:
            lo, hi = self.config.large_result_bytes
        return self.rng.randint(lo, hi)

    def tool_calls(self, conversation: str) -> tuple[ToolCall, ...]:
        calls = []
        for _ in range(1 if self.rng.random() < 0.75 else 2):
            self.call_count += 1
            call_id = f"call_{self.config.seed:04d}{self.call_count:028d}"  # 37 characters like vLLM's
            kind = self.rng.choice(("read_file", "read_file", "grep", "run_tests"))
            module = self.rng.randrange(200)
            arguments: dict[str, Any] = {
                "read_file": {"path": f"src/mod_{module}.py", "offset": self.rng.randrange(0, 400, 20)},
                "grep": {"pattern": f"def \\w+_{module}", "paths": ["src", "tests"]},
                "run_tests": {"paths": [f"tests/test_mod_{module}.py"], "verbose": False},
            }[kind]
            result = file_text(self.rng, self.result_size(), f"{conversation} {kind} {module}")
            calls.append(ToolCall(call_id, kind, arguments, result))
        return tuple(calls)


def plan_traffic(config: TrafficConfig) -> list[PlannedRequest]:
    """The request list of one run: a pure function of `config` (and so of its seed)."""
    p = _Planner(config)
    names = [f"agent-{i}" for i in range(config.conversations)]
    tasks = {
        name: f"Task of {name}: review modules {i * 10} to {i * 10 + 9} and fix what the tests show."
        for i, name in enumerate(names)
    }
    subagent: dict[str, Any] | None = None  # {"name", "parent", "left"}
    one_offs = 0
    folder = {name: (name, "clean") for name in names} if config.folders else {}
    retries: list[str] = []
    for round_no in range(1, config.rounds + 1):
        phase = 1 if 0 < config.restart_after_round < round_no else 0
        order = names[:]
        if config.folders:  # a new folder each round; one session retried after the restart
            if round_no == config.restart_after_round + 1:
                retries.append(f"{names[0]}/retry")
                folder[retries[0]] = (names[0], "2 files modified")
                tasks[retries[0]] = tasks[names[0]]
            order = names[:round_no] + retries
        p.rng.shuffle(order)
        for name in order:
            where = dict(zip(("folder", "status"), folder.get(name, ("", "")), strict=True))
            if name not in p.turns:
                p.add(phase, name, "main", user=tasks[name], **where)
            elif subagent is not None and subagent["parent"] == name and subagent["left"] > 0:
                continue  # the parent waits for its sub-agent
            elif subagent is not None and subagent["parent"] == name and subagent["left"] == 0:
                report = file_text(p.rng, 1200, f"report of {subagent['name']}")
                spawn = ToolCall(subagent["call_id"], "spawn_agent", {"task": subagent["task"]}, report)
                p.add(phase, name, "main", calls=(spawn,), **where)
                subagent["left"] = -1
            else:
                p.add(phase, name, "main", calls=p.tool_calls(name), **where)
            if subagent is not None and subagent["left"] > 0 and subagent["parent"] != name:
                # the sub-agent runs between its parent's siblings, one turn at a time
                first = subagent["name"] not in p.turns
                p.add(
                    phase,
                    subagent["name"],
                    "subagent",
                    user=subagent["task"] if first else None,
                    calls=() if first else p.tool_calls(subagent["name"]),
                )
                subagent["left"] -= 1
        if round_no == config.subagent_round and subagent is None:
            started = min(len(names), round_no) if config.folders else len(names)
            parent = names[p.rng.randrange(started)]
            p.call_count += 1
            subagent = {
                "name": f"{parent}/sub",
                "parent": parent,
                "left": config.subagent_turns,
                "task": f"Find every caller of module {p.rng.randrange(200)} and list what each expects.",
                "call_id": f"call_{config.seed:04d}{p.call_count:028d}",
            }
        if config.one_off_every and round_no % config.one_off_every == 0:
            one_offs += 1
            text = file_text(p.rng, p.rng.randint(300, 900), f"one-off {one_offs}")
            p.add(
                phase,
                f"one-off-{one_offs}",
                "one-off",
                user=f"Summarize this file in one line:\n{text}",
                system=False,
            )
    return p.requests


@dataclasses.dataclass
class RequestRecord:
    """What one request measured; usage fields as the server reported them."""

    index: int
    phase: int
    conversation: str
    kind: str
    turn: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # prompt_tokens_details.cached_tokens (OpenAI's field)
    hit_tokens: int | None  # prompt_cache_hit_tokens (ds4 / DeepSeek API field)
    miss_tokens: int | None
    disk_tokens: int | None
    ttft_s: float
    total_s: float
    decode_tokens_per_s: float | None
    reply: str

    @property
    def reused_tokens(self) -> int:
        """Reused prompt tokens: ds4's hit field, else OpenAI's cached_tokens, else 0."""
        if self.hit_tokens is not None:
            return self.hit_tokens
        return self.cached_tokens or 0


class Conversations:
    """The client's message lists, built from the plan and the server's replies."""

    def __init__(self, config: TrafficConfig) -> None:
        self.rules = config.system_rules
        self.histories: dict[str, list[dict[str, Any]]] = {}
        self.pending_reply: dict[str, str] = {}

    def messages(self, request: PlannedRequest) -> list[dict[str, Any]]:
        """The history `request` sends: the previous reply with its planned tool calls, the
        results, the user message."""
        history = self.histories.get(request.conversation)
        if history is None:
            system = system_prompt(self.rules, request.folder, request.status)
            history = [{"role": "system", "content": system}] if request.system else []
            self.histories[request.conversation] = history
        if request.turn > 1:
            reply = self.pending_reply.pop(request.conversation, "")
            assistant: dict[str, Any] = {"role": "assistant", "content": reply}
            if request.calls:
                assistant["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                    }
                    for c in request.calls
                ]
            history.append(assistant)
            history += [{"role": "tool", "tool_call_id": c.id, "content": c.result} for c in request.calls]
        if request.user is not None:
            history.append({"role": "user", "content": request.user})
        elif request.turn > 1 and not request.calls:
            history.append({"role": "user", "content": "Continue."})
        return list(history)

    def record_reply(self, request: PlannedRequest, reply: str) -> None:
        self.pending_reply[request.conversation] = reply


def send(
    client: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, max_tokens: int
) -> dict[str, Any]:
    """One streamed chat completion: TTFT, decode speed, reply text and the final usage."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        # Non-thinking mode, as agents run tool loops: the reply is visible text that goes back
        # into the history verbatim (in thinking mode 16 tokens are all hidden reasoning, which
        # ds4's template drops from earlier turns, so the history would not extend the prompt).
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    first = last = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            text = choice.delta.content or ""
            hidden = getattr(choice.delta, "reasoning_content", None) or getattr(
                choice.delta, "reasoning", None
            )
            if text or hidden or choice.delta.tool_calls:
                first = now if first is None else first
                last = now
                parts.append(text)
            elif choice.finish_reason is not None:
                first = now if first is None else first
                last = now
    end = time.perf_counter()
    first = end if first is None else first
    return {
        "ttft_s": first - t0,
        "total_s": end - t0,
        "last_s": (last or end) - t0,
        "reply": "".join(parts),
        "usage": usage,
    }


def run_traffic(
    base_url: str,
    plan: Iterable[PlannedRequest],
    config: TrafficConfig,
    *,
    restart: Callable[[], str] | None = None,
    after_request: Callable[[RequestRecord], None] | None = None,
    progress: Any = None,
) -> list[RequestRecord]:
    """Send the plan in order to `base_url` (an OpenAI-compatible server's root URL).

    Before the first request of phase 1, `restart()` runs and returns the new server's base URL.
    `after_request` sees each record as it completes (disk sampling); `progress` is a tqdm bar.
    """
    from openai import OpenAI

    def client_for(url: str) -> Any:
        return OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=1800, max_retries=0)

    client = client_for(base_url)
    conversations = Conversations(config)
    records: list[RequestRecord] = []
    phase = 0
    for request in plan:
        if request.phase != phase:
            phase = request.phase
            if restart is not None:
                client = client_for(restart())
        messages = conversations.messages(request)
        result = send(client, messages, TOOLS if request.system else None, config.max_tokens)
        conversations.record_reply(request, result["reply"])
        usage = result["usage"]
        details = usage.get("prompt_tokens_details") or {}
        completion = int(usage.get("completion_tokens") or 0)
        decode_s = result["last_s"] - result["ttft_s"]
        record = RequestRecord(
            index=request.index,
            phase=request.phase,
            conversation=request.conversation,
            kind=request.kind,
            turn=request.turn,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=completion,
            cached_tokens=details.get("cached_tokens"),
            hit_tokens=usage.get("prompt_cache_hit_tokens"),
            miss_tokens=usage.get("prompt_cache_miss_tokens"),
            disk_tokens=usage.get("prompt_cache_disk_tokens"),
            ttft_s=result["ttft_s"],
            total_s=result["total_s"],
            decode_tokens_per_s=(completion - 1) / decode_s if completion > 2 and decode_s > 0 else None,
            reply=result["reply"],
        )
        records.append(record)
        if after_request is not None:
            after_request(record)
        if progress is not None:
            progress.update(1)
    return records


def plan_summary(plan: list[PlannedRequest]) -> dict[str, Any]:
    """Counts a reader checks the plan by: requests per kind and phase, tool-result sizes."""
    sizes = [len(c.result.encode()) for r in plan for c in r.calls]
    return {
        "requests": len(plan),
        "by_kind": {k: sum(r.kind == k for r in plan) for k in ("main", "subagent", "one-off")},
        "by_phase": {str(ph): sum(r.phase == ph for r in plan) for ph in (0, 1)},
        "conversations": len({r.conversation for r in plan}),
        "tool_results": len(sizes),
        "tool_result_bytes_min": min(sizes, default=0),
        "tool_result_bytes_max": max(sizes, default=0),
        "tool_result_bytes_median": sorted(sizes)[len(sizes) // 2] if sizes else 0,
    }
