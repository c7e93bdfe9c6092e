"""Issue 20: random request mixes against a live `vllm serve --kv-connector ds4disk`, with restarts.

A seeded random driver sends chat and completion requests that mix `seed`, `n`,
`temperature`, `logprobs`, `stop`, `max_tokens`, `stream` (with and without usage), tools and
every `tool_choice`, over prompts whose lengths straddle the 512-token prefill chunk (so seeded
requests take partial prefills), drawn from a small pool so that later requests hit vLLM's memory
or, after a restart, the checkpoints on disk. A seeded or greedy request already answered is sent
again, before or after a restart, and must answer the same. The server is restarted (SIGINT,
same directory) at fixed request counts.

Invariants after every request: no 5xx; the server process is alive; usage hit + miss = prompt
(`prompt_cache_hit_tokens + prompt_cache_miss_tokens == prompt_tokens`, also on streams that ask
for usage). Repeats of seeded or greedy requests are counted and compared, not asserted: the
same answer needs the same float32 sums, and a repeat may find another prefix cached (other
prefill chunks), the same length cached in blocks another request computed in other chunks, or,
with `n` 2, its samples decoded in one batch or two; the random tiny model's near-tied logits
then flip a token now and then. The run prints how often (`test_seeded_sampling` shows restored
= cold exactly where the cache state is the same).

`heavy` (about 25 minutes for 2,000 requests and 3 restarts on the 2-core machine);
`DS4_PROPERTY_REQUESTS=N` and `DS4_PROPERTY_RESTARTS=K` run a smaller mix, `DS4_PROPERTY_SEED`
another one. float32, so that a restored prefix computes the same numbers as a cold one.

Not hypothesis: its first example is always its simplest (every optional field absent,
`max_tokens` 1), and one example is all that 2,000 live requests can afford; the driver draws
every field itself from a seeded `random.Random`, so a run is reproducible from its seed.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

REQUESTS = int(os.environ.get("DS4_PROPERTY_REQUESTS", "2000"))
#: The driver's seed: a failure names the request, and the same seed sends the same sequence.
SEED = int(os.environ.get("DS4_PROPERTY_SEED", "20"))
RESTARTS = int(os.environ.get("DS4_PROPERTY_RESTARTS", "3"))
CHUNK = 512
ARGS = [
    "--model", "ds4", "--dtype", "float32", "--max-model-len", "4096",
    "--max-num-batched-tokens", str(CHUNK), "--kv-cache-min-tokens", "64",
    "--enable-auto-tool-choice", "--tool-call-parser", "ds4", "--reasoning-parser", "ds4",
]  # fmt: skip

WORDS = (
    "agent cache prefix token model server restart disk file chunk seed sample tool call answer "
    "python rust kernel branch commit review patch folder memory state layer expert router"
).split()
#: Prompt lengths in words (about one token each): below, at and across the 512-token chunk.
DOC_WORDS = (60, 300, 505, 515, 700, 1030, 1600)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
    },
]


#: What the last run did, for the closing assertions and the printed summary.
RUN = {
    "requests": 0,
    "restarts": 0,
    "usage_checked": 0,
    "repeats_compared": 0,
    "repeats_differing": 0,
    "repeats_other_prefix": 0,
    "repeats_other_prefix_differing": 0,
    "repeats_n2": 0,
    "repeats_n2_differing": 0,
}
#: Repeats that answered otherwise, described.
DIFFERING: list[str] = []
#: How many requests carried each feature.
FEATURES: dict[str, int] = {}
#: The 4xx answers by status, route and message (refusals the API documents, e.g. a forced
#: tool choice on a request that cannot call one).
REFUSED: dict[str, int] = {}


def document(index: int, words: int) -> str:
    rng = random.Random(index)
    return " ".join(rng.choice(WORDS) for _ in range(words))


DOCUMENTS = [document(i, n) for i, n in enumerate(DOC_WORDS)]


def draw_common(rng: random.Random) -> dict:
    """max_tokens always; seed, temperature, n and stop each in about half of the requests."""
    body: dict = {"max_tokens": rng.randint(1, 12)}
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.6:
        body["temperature"] = rng.choice([0.0, 0.7, 1.0])
    if rng.random() < 0.3:
        body["n"] = 2
    if rng.random() < 0.3:
        body["stop"] = rng.sample(["\n", " the", "agent", "."], rng.randint(1, 2))
    return body


def draw_prompt(rng: random.Random) -> tuple[int, str]:
    """A document of the pool (lengths across the chunk) and a short tail."""
    return rng.randrange(len(DOCUMENTS)), rng.choice(["", " Why?", " Summarize.", " Next"])


TOOL_CHOICES = ["auto", "none", "required", {"type": "function", "function": {"name": "read_file"}}]


def chat_body(draw_common: dict, doc: tuple[int, str], tools: object, logprobs: int | None) -> dict:
    body = {
        "model": "ds4",
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": DOCUMENTS[doc[0]] + doc[1]},
        ],
        **draw_common,
    }
    if tools is not None:
        body["tools"] = TOOLS
        body["tool_choice"] = tools
    if logprobs is not None:
        body["logprobs"] = True
        body["top_logprobs"] = logprobs
    return body


def completion_body(draw_common: dict, doc: tuple[int, str], logprobs: int | None) -> dict:
    body = {"model": "ds4", "prompt": DOCUMENTS[doc[0]] + doc[1], **draw_common}
    if logprobs is not None:
        body["logprobs"] = logprobs
    return body


def describe(body: dict, stream: bool | None) -> str:
    """A request in one line: its sampling fields, its prompt's size, whether it streamed."""
    fields = {k: v for k, v in body.items() if k not in ("messages", "prompt", "tools", "model")}
    text = body.get("prompt") or body["messages"][-1]["content"]
    return f"{json.dumps(fields)} tools={'tools' in body} stream={stream} prompt {len(text)} chars"


def repeatable(body: dict) -> bool:
    """Whether the same body must answer the same: seeded, or greedy."""
    return "seed" in body or body.get("temperature", 1.0) == 0.0


class LiveServer:
    """The server under test, restarted on the same directory, and what it answered so far."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.disk = work / "kv"
        self.server: ServerProcess | None = None
        self.requests = 0
        self.restarts = 0
        #: key -> (texts, restarts before the answer, prompt tokens it found cached)
        self.answers: dict[str, tuple[list[str], int, int]] = {}
        self._start()

    def _start(self) -> None:
        args = [*ARGS, "--kv-connector", "ds4disk", "--kv-disk-dir", str(self.disk)]
        self.server = ServerProcess(args, self.work / f"serve-{self.restarts}.log").start(timeout=600)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def restart(self) -> None:
        assert self.server is not None
        assert self.server.stop() is not None
        self.restarts += 1
        RUN["restarts"] = self.restarts
        self._start()

    def step(self, rng: random.Random) -> None:
        """One request: a repeat of an answered seeded or greedy one (1 in 5), or a new one."""
        if self.answers and rng.random() < 0.2:
            path, body, stream = json.loads(rng.choice(sorted(self.answers)))
            self.send(path, body, stream)
        elif rng.random() < 0.7:
            tools = rng.choice(TOOL_CHOICES) if rng.random() < 0.4 else None
            logprobs = rng.randint(0, 3) if rng.random() < 0.3 else None
            body = chat_body(draw_common(rng), draw_prompt(rng), tools, logprobs)
            self.send("/v1/chat/completions", body, rng.choice([None, False, True]))
        else:
            logprobs = rng.randint(0, 3) if rng.random() < 0.3 else None
            body = completion_body(draw_common(rng), draw_prompt(rng), logprobs)
            self.send("/v1/completions", body, rng.choice([None, True]))

    # ------------------------------------------------------------------ one request

    def send(self, path: str, body: dict, stream: bool | None) -> None:
        assert self.server is not None
        self.requests += 1
        RUN["requests"] = self.requests
        for feature, present in {
            "seed": "seed" in body,
            "n=2": body.get("n") == 2,
            "stream": bool(stream),
            "tools": "tools" in body,
            "logprobs": "logprobs" in body,
            "stop": "stop" in body,
            "over one chunk": len(str(body.get("prompt") or body.get("messages"))) > 6 * CHUNK,
        }.items():
            FEATURES[feature] = FEATURES.get(feature, 0) + present
        payload = dict(body)
        if stream:
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
        elif stream is False:
            payload["stream"] = False
        url = self.server.base_url + path
        if stream:
            texts, usage, status, error = self._stream(url, payload)
        else:
            response = httpx.post(url, json=payload, timeout=600)
            status = response.status_code
            data = response.json() if status < 500 else {}
            error = response.text if status != 200 else ""
            usage = data.get("usage")
            texts = [_choice_text(c) for c in data.get("choices", [])]
        assert status < 500, f"{status} for {path} {json.dumps(payload)[:300]}"
        assert self.server.proc is not None and self.server.proc.poll() is None, self.server.log_tail()
        if status != 200:
            REFUSED[f"{status} {path}: {error[:120]}"] = REFUSED.get(f"{status} {path}: {error[:120]}", 0) + 1
            return
        assert usage is not None, f"no usage for {path}"
        hit, miss = usage.get("prompt_cache_hit_tokens"), usage.get("prompt_cache_miss_tokens")
        assert hit is not None and miss is not None and hit + miss == usage["prompt_tokens"], usage
        RUN["usage_checked"] += 1
        if repeatable(body):
            key = json.dumps([path, body, stream], sort_keys=True)
            now = (texts, self.restarts, hit)
            before = self.answers.setdefault(key, now)
            if before is not now and before[2] != hit:
                # Another cached prefix means other prefill chunks: float32 sums in another order,
                # and a random model's near-tied logits may then pick another token. Counted.
                RUN["repeats_other_prefix"] += 1
                RUN["repeats_other_prefix_differing"] += before[0] != texts
                return
            if before is not now and body.get("n", 1) > 1:
                # n samples may decode in one batch row block or in two (vLLM schedules the
                # children as they become ready): other GEMM shapes, the same near-tie effect.
                RUN["repeats_n2"] += 1
                RUN["repeats_n2_differing"] += before[0] != texts
                return
            if before is not now:
                RUN["repeats_compared"] += 1
                if before[0] != texts:
                    # Measured, not asserted: the same cached length may hold blocks another
                    # request computed in other chunks (see the module docstring).
                    RUN["repeats_differing"] += 1
                    DIFFERING.append(
                        f"{path} {describe(body, stream)}: {texts!r} (after {self.restarts} restarts, "
                        f"{hit} cached) vs {before[0]!r} (after {before[1]} restarts, {before[2]} cached)"
                    )

    def _stream(self, url: str, payload: dict) -> tuple[list[str], dict | None, int, str]:
        texts: dict[int, str] = {}
        usage = None
        with httpx.stream("POST", url, json=payload, timeout=600) as response:
            if response.status_code != 200:
                return [], None, response.status_code, response.read().decode(errors="replace")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # an error inside a started stream (HTTP status already 200)
                    return [], None, int(chunk["error"].get("code") or 500), line
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    texts[choice["index"]] = texts.get(choice["index"], "") + _choice_text(choice)
        return [texts[i] for i in sorted(texts)], usage, 200, ""


def _choice_text(choice: dict) -> str:
    """Everything a choice said: text, reasoning and content, tool-call names and arguments."""
    if "text" in choice:
        return choice["text"] or ""
    message = choice.get("message") or choice.get("delta") or {}
    calls = message.get("tool_calls") or []
    said = [message.get("reasoning") or "", message.get("content") or ""]
    said += [
        f"{c.get('function', {}).get('name') or ''}({c.get('function', {}).get('arguments') or ''})"
        for c in calls
    ]
    return "".join(said)


def test_random_requests_with_restarts_keep_every_invariant(tmp_path: Path) -> None:
    RUN.update({key: 0 for key in RUN})
    FEATURES.clear()
    REFUSED.clear()
    DIFFERING.clear()
    rng = random.Random(SEED)
    live = LiveServer(tmp_path)
    try:
        for n in range(REQUESTS):
            if live.restarts < RESTARTS and n >= (live.restarts + 1) * REQUESTS // (RESTARTS + 1):
                live.restart()
            live.step(rng)
    finally:
        live.stop()
    print(f"property run: {RUN}; requests with: {FEATURES}; refused: {REFUSED}")
    print("repeats that answered otherwise:", *DIFFERING[:10], sep="\n  ")
    assert RUN["requests"] == REQUESTS and RUN["restarts"] == RESTARTS, RUN
    assert RUN["repeats_compared"] > 0 and all(FEATURES.values()), (RUN, FEATURES)
