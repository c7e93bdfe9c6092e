"""Issue 11: the agent-traffic generator and the benchmark report keep working.

The plan tests are pure. The slow test sends a reduced plan (2 conversations, a sub-agent, a
one-off, a restart) through two real `vllm serve --model ds4 --kv-connector ds4disk` processes
and writes the whole report; it checks the report's structure and that every figure comes from
the servers' usage fields. No timing is asserted (the machine is shared).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from benchmarks.agent_traffic import Conversations, TrafficConfig, plan_summary, plan_traffic
from benchmarks.report import run_parts, run_report
from benchmarks.traffic_render import part_markdown

#: The smallest plan with every feature: 2 conversations, a sub-agent, a one-off, a restart, a
#: large tool result. 20 rules of system prompt (about 800 prompt tokens with the tools) keep
#: prompts above the connector's 512-token minimum, so checkpoints are written.
TINY = TrafficConfig(
    conversations=2,
    rounds=3,
    restart_after_round=2,
    system_rules=20,
    subagent_round=1,
    subagent_turns=1,
    one_off_every=2,
    large_result_every=3,
)


def test_the_plan_is_a_function_of_the_seed() -> None:
    assert plan_traffic(TINY) == plan_traffic(TINY)
    assert plan_traffic(TINY) != plan_traffic(dataclasses.replace(TINY, seed=12))


def test_the_plan_has_every_kind_of_request_and_a_restart() -> None:
    plan = plan_traffic(TINY)
    summary = plan_summary(plan)
    # rounds of 2, 1 and 2 main requests: agent-1 waits for its sub-agent in round 2
    assert summary["by_kind"] == {"main": 5, "subagent": 1, "one-off": 1}
    assert summary["by_phase"] == {"0": 5, "1": 2}
    # phase 0 then phase 1: the restart happens once, between rounds 2 and 3
    assert [r.phase for r in plan] == sorted(r.phase for r in plan)
    assert summary["tool_result_bytes_min"] >= TINY.small_result_bytes[0]
    assert summary["tool_result_bytes_max"] >= TINY.large_result_bytes[0]
    # the parent gets its sub-agent's report back as the result of a spawn_agent call
    spawns = [c for r in plan for c in r.calls if c.name == "spawn_agent"]
    assert len(spawns) == 1


def test_histories_hold_the_servers_reply_with_the_planned_calls() -> None:
    plan = plan_traffic(TINY)
    conversations = Conversations(TINY)
    first = next(r for r in plan if r.conversation == "agent-0")
    second = next(r for r in plan if r.conversation == "agent-0" and r.turn == 2)
    assert [m["role"] for m in conversations.messages(first)] == ["system", "user"]
    conversations.record_reply(first, "Looking.")
    messages = conversations.messages(second)
    assistant = messages[2]
    assert assistant["content"] == "Looking."
    assert [c["id"] for c in assistant["tool_calls"]] == [c.id for c in second.calls]
    assert [m["content"] for m in messages[3:]] == [c.result for c in second.calls]


def test_the_folders_scenario_names_each_sessions_folder_late_in_its_system_prompt() -> None:
    """Issue 21's scenario: sessions start one round apart, each in its own folder, named late in
    its system prompt; after the restart one session is retried with its status line changed."""
    config = dataclasses.replace(TINY, conversations=3, rounds=4, folders=True)
    plan = plan_traffic(config)
    firsts = {r.conversation: r for r in plan if r.turn == 1 and r.kind == "main"}
    assert {n: (r.folder, r.status) for n, r in firsts.items()} == {
        "agent-0": ("agent-0", "clean"),
        "agent-1": ("agent-1", "clean"),
        "agent-2": ("agent-2", "clean"),
        "agent-0/retry": ("agent-0", "2 files modified"),
    }
    # a new folder each round, the retry after the restart
    order = [r.conversation for r in plan if r.turn == 1 and r.kind == "main"]
    assert order.index("agent-0") < order.index("agent-1") < order.index("agent-2")
    assert firsts["agent-0/retry"].phase == 1
    systems = {n: Conversations(config).messages(r)[0]["content"] for n, r in firsts.items()}
    shared = len(os.path.commonprefix([systems["agent-0"], systems["agent-1"]]))
    assert 0.8 < shared / len(systems["agent-0"]) < 0.9  # they part late, at the folder's line
    assert systems["agent-0/retry"].index("Status") == systems["agent-0"].index("Status")
    assert systems["agent-0/retry"] != systems["agent-0"]
    # the default scenario is unchanged: one system prompt for every session
    assert all(r.folder == "" for r in plan_traffic(TINY))


def test_an_absent_part_is_skipped_with_a_note(tmp_path) -> None:
    parts = run_parts(tmp_path, quick=True, names=("no_such_part",))
    assert parts == {
        "no_such_part": {"skipped": "benchmarks/no_such_part.py not present (benchmarks.no_such_part)"}
    }


def test_a_parts_tables_and_plots_go_into_the_report() -> None:
    part = {"table_markdown": "| a | b |\n|---|---|", "plots": ["micro.png"], "wall_s": 3.0}
    assert part_markdown("micro", part) == [
        "## micro",
        "",
        "| a | b |\n|---|---|",
        "",
        "![micro.png](micro.png)",
        "",
    ]
    assert part_markdown("micro", {"skipped": "failed: x"}) == ["## micro", "", "Skipped: failed: x", ""]


# heavy: about 80 s (a real server and the whole quick report); CI keeps the parts above.
@pytest.mark.slow
@pytest.mark.heavy
def test_quick_report_against_a_real_server(tmp_path) -> None:
    report = run_report(tmp_path, TINY, mode="quick", systems=["ds4disk"], parts=False)
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["agent_traffic"]["plan"] == plan_summary(plan_traffic(TINY))
    system = written["agent_traffic"]["systems"]["ds4disk"]
    assert system["error"] is None, system
    assert system["requests"] == len(plan_traffic(TINY))
    assert system["usage_fields_present"] == {
        "cached_tokens": True,
        "prompt_cache_hit_tokens": True,
        "prompt_cache_miss_tokens": True,
        "hit_plus_miss_is_prompt": True,
    }
    records = written["agent_traffic"]["requests"]["ds4disk"]
    assert system["reused_tokens"] == sum(r["hit_tokens"] for r in records) > 0
    assert system["computed_tokens"] == sum(r["miss_tokens"] for r in records)
    # after the restart, memory is empty: each continued conversation's reuse is from disk
    restarted = [r for r in records if r["phase"] == 1 and r["kind"] == "main"]
    assert restarted and all(r["disk_tokens"] == r["hit_tokens"] > 0 for r in restarted), restarted
    assert system["disk_bytes_written"] > 0 and system["disk_bytes_read"] > 0
    assert system["disk"]["files_seen"] >= 1 and system["disk"]["peak_disk_bytes"] > 0
    assert set(written["agent_traffic"]["plots"]) == {"ttft_by_request.png", "hit_rate.png"}
    assert all((tmp_path / p).stat().st_size > 0 for p in written["agent_traffic"]["plots"])
    assert "| hit rate (all / after warm-up) |" in (tmp_path / "report.md").read_text()
    assert report.to_json()["agent_traffic"]["systems"] == written["agent_traffic"]["systems"]
