"""Issue 20: real agent clients against `vllm serve --model ds4 --kv-connector ds4disk`.

Each client is the published npm package (pinned below, installed into a cache folder on first
use), run non-interactively as a user would in a project folder: three turns of one session, the
server stopped with SIGINT after the second turn and started again on the same checkpoint
directory. What a user would notice is asserted: the client's exit status, and from the server's
`--trace` (one block per request) how much of each prompt was reused and from where.

The tiny default model has random weights and would never end an answer, so the server loads
`answer_length.EndAnswersAfter` (vLLM's ``--logits-processors``): every answer ends after a few
tokens, as a trained model's would. Clients that read an absent ``thinking`` field as "no
thinking" get the documented server flag (docs/clients.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.server_process import ServerProcess
from tests.serving.test_agent_loop import trace_decisions

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

CLIENTS = {"claude": "@anthropic-ai/claude-code@2.1.197", "codex": "@openai/codex@0.171.0"}
CLIENT_DIR = Path(
    os.environ.get("DS4_TEST_CLIENTS_DIR", Path.home() / ".cache" / "ds4-vllm" / "test-clients")
)
MIN_REUSE = 0.9
TURNS = ["Say hello.", "Now say it again, shorter.", "And once more."]
RESTART_AFTER = 2  # turns on the first server process; the rest on a restarted one


def installed(binary: str) -> Path:
    """The client's executable, installed with npm into CLIENT_DIR on first use."""
    path = CLIENT_DIR / "node_modules" / ".bin" / binary
    if not path.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed: the real clients come from npm")
        CLIENT_DIR.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--prefix", str(CLIENT_DIR), *CLIENTS.values()],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0 or not path.exists():  # offline: the clients cannot be had here
            pytest.skip(f"npm install {' '.join(CLIENTS.values())} failed: {done.stderr[-500:]}")
    return path


@dataclass
class TurnResult:
    exit_status: int
    stdout: str
    stderr: str
    requests: list[dict[str, str]]  # the server's trace blocks of this turn's requests

    def reuse(self) -> list[float]:
        return [int(r["cached_tokens"]) / int(r["prompt_tokens"]) for r in self.requests]


def serve(disk: Path, log: Path, trace: Path, extra: list[str]) -> ServerProcess:
    args = [
        "--model", "ds4", "--max-model-len", "32768",
        "--kv-connector", "ds4disk", "--kv-disk-dir", str(disk), "--trace", str(trace),
        "--logits-processors", "tests.e2e.answer_length:EndAnswersAfter",
        *extra,
    ]  # fmt: skip
    repo = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    return ServerProcess(args, log, env=env).start()


def run_session(tmp: Path, client_command, extra_server_args: list[str]) -> list[TurnResult]:
    """The session's turns, restarting the server after RESTART_AFTER turns."""
    disk, folder = tmp / "kv", tmp / "project"
    folder.mkdir()
    (folder / "README.md").write_text("A project folder for the client test.\n")
    results: list[TurnResult] = []
    for server_name, turns in (("first", TURNS[:RESTART_AFTER]), ("restarted", TURNS[RESTART_AFTER:])):
        trace = tmp / f"trace-{server_name}.txt"
        server = serve(disk, tmp / f"serve-{server_name}.log", trace, extra_server_args)
        try:
            for text in turns:
                seen = len(trace_decisions(trace)) if trace.exists() else 0
                done = client_command(server.base_url, folder, text, first=not results, home=tmp / "home")
                (tmp / f"client-turn{len(results) + 1}.out").write_text(
                    done.stdout + "\n--- stderr\n" + done.stderr
                )
                requests = trace_decisions(trace)[seen:]
                results.append(TurnResult(done.returncode, done.stdout, done.stderr, requests))
        finally:
            server.stop()
    return results


def claude_turn(
    base_url: str, folder: Path, text: str, first: bool, home: Path
) -> subprocess.CompletedProcess:
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": "ds4",
        "ANTHROPIC_SMALL_FAST_MODEL": "ds4",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "ds4",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "API_TIMEOUT_MS": "1200000",
    }
    command = [str(installed("claude")), "-p", text, "--output-format", "json", "--model", "ds4"]
    if not first:
        command.append("--continue")
    return subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL
    )


@pytest.fixture(scope="module")
def claude_session(tmp_path_factory) -> list[TurnResult]:
    # Claude Code reads an absent `thinking` as Anthropic does: no thinking (docs/clients.md).
    no_thinking = ["--default-chat-template-kwargs", '{"ds4_messages_thinking": false}']
    return run_session(tmp_path_factory.mktemp("claude"), claude_turn, no_thinking)


CODEX_CONFIG = """model = "ds4"
model_provider = "ds4"
[model_providers.ds4]
name = "ds4-vllm"
base_url = "{base_url}/v1"
wire_api = "responses"
"""


def codex_turn(
    base_url: str, folder: Path, text: str, first: bool, home: Path
) -> subprocess.CompletedProcess:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(base_url=base_url))
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CODEX_HOME": str(codex_home),
        "OPENAI_API_KEY": "unused",
    }
    codex = str(installed("codex"))
    options = ["--skip-git-repo-check", "--json"]
    command = (
        [codex, "exec", *options, text] if first else [codex, "exec", "resume", "--last", *options, text]
    )
    return subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL
    )


@pytest.fixture(scope="module")
def codex_session(tmp_path_factory) -> list[TurnResult]:
    return run_session(tmp_path_factory.mktemp("codex"), codex_turn, [])


def reuse_line(session: list[TurnResult]) -> str:
    return "; ".join(
        f"turn {turn}: "
        + ", ".join(
            f"{r['cached_tokens']}/{r['prompt_tokens']} ({r['cache_source']})" for r in result.requests
        )
        for turn, result in enumerate(session, 1)
    )


def assert_reuse(session: list[TurnResult]) -> None:
    """Every request of every turn from the second reuses MIN_REUSE of its prompt; the first
    request after the restart reads it from disk."""
    print(reuse_line(session))
    for turn, result in enumerate(session, 1):
        assert result.requests, f"turn {turn}: no request reached the server"
        if turn > 1:
            assert min(result.reuse()) >= MIN_REUSE, (turn, result.requests)
    after_restart = session[RESTART_AFTER].requests[0]
    assert after_restart["cache_source"] == "disk", after_restart


def test_codex_exits_0_on_every_turn(codex_session) -> None:
    for turn, result in enumerate(codex_session, 1):
        assert result.exit_status == 0, f"turn {turn}: {result.stdout[-1500:] + result.stderr[-1500:]}"
        events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        assert any(e.get("type") == "turn.completed" for e in events), (
            result.stdout[-1500:] + result.stderr[-1500:]
        )
        assert not any(e.get("type") in ("error", "turn.failed") for e in events), (
            result.stdout[-1500:] + result.stderr[-1500:]
        )
        # the answer's text reached the user as an agent message
        messages = [
            e["item"]["text"]
            for e in events
            if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
        ]
        assert messages and messages[-1].strip(), result.stdout[-1500:] + result.stderr[-1500:]


def test_codex_turns_reuse_their_prompt_and_the_restart_reads_disk(codex_session) -> None:
    assert_reuse(codex_session)


def test_claude_code_exits_0_on_every_turn(claude_session) -> None:
    for turn, result in enumerate(claude_session, 1):
        assert result.exit_status == 0, f"turn {turn}: {result.stdout[-1500:] + result.stderr[-1500:]}"
        answer = json.loads(result.stdout.strip().splitlines()[-1])
        assert answer["is_error"] is False and answer["stop_reason"] == "end_turn", answer
        # the answer's text reached the user, in one model call (no "no visible output" retry)
        assert answer["result"].strip() and answer["num_turns"] == 1, answer


def test_claude_code_turns_reuse_their_prompt_and_the_restart_reads_disk(claude_session) -> None:
    assert_reuse(claude_session)


#: Issue 21's goals: the first folder to part from another reuses all but 2,048 tokens of what
#: they share, the third all but 512.
GOAL_SECOND, GOAL_THIRD = 2048, 512


@pytest.fixture(scope="module")
def claude_folders(tmp_path_factory) -> list[dict[str, str]]:
    """Claude Code's first turn in three project folders on one server: its system prompt names
    the folder (working directory, project memory path). The server's trace block of each."""
    tmp = tmp_path_factory.mktemp("claude-folders")
    trace = tmp / "trace.txt"
    server = serve(tmp / "kv", tmp / "serve.log", trace, [])
    blocks = []
    try:
        for name in ("alpha-service", "beta-service", "gamma-service"):
            folder = tmp / "projects" / name
            folder.mkdir(parents=True)
            seen = len(trace_decisions(trace)) if trace.exists() else 0
            done = claude_turn(server.base_url, folder, "Say hello.", first=True, home=tmp / "home")
            assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
            blocks += trace_decisions(trace)[seen:]
    finally:
        server.stop()
    print(
        "claude folders: "
        + "; ".join(
            f"{b['cached_tokens']}/{b['prompt_tokens']} shared {b.get('shared_tokens', 0)}" for b in blocks
        )
    )
    return blocks


def test_claude_code_in_a_new_folder_reuses_what_it_shares_with_the_others(claude_folders) -> None:
    """`shared_tokens`: the prompt's tokens a known checkpoint's text shares (up to the last
    line end before they part)."""
    assert len(claude_folders) == 3, claude_folders  # one request per folder
    second, third = claude_folders[1], claude_folders[2]
    for block, goal in ((second, GOAL_SECOND), (third, GOAL_THIRD)):
        shared, cached = int(block["shared_tokens"]), int(block["cached_tokens"])
        assert shared - goal <= cached <= int(block["prompt_tokens"]), block
