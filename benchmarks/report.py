"""One benchmark report (issue 11): agent traffic against four prefix-cache set-ups, plus optional parts.

    python -m benchmarks.report quick    # 3 conversations, 4 rounds (35 min at load 50-80, 8 server starts)
    python -m benchmarks.report full     # 4 conversations, 24 rounds (107 requests per system)
    python -m benchmarks.report quick --systems ds4disk memory --no-parts

Both write `benchmarks/results/<YYYY-MM-DD>/` (or `--out DIR`): `report.json` (every figure,
every request), `report.md` (tables), `ttft_by_request.png`, `hit_rate.png`, and what the
optional parts add. An optional part is a module `benchmarks/<name>.py` with
`run(results_dir: Path, quick: bool) -> dict`; its dict goes under `parts.<name>` of the JSON,
its `"markdown"` string (if any) into the Markdown file, and its `"plots"` (file names in
`results_dir`) are linked. A part that is absent or fails is skipped with a note.

Every system runs the same planned traffic (`agent_traffic.plan_traffic`) in this one process,
one after the other, each against fresh `vllm serve` processes on loopback and a fresh
directory; the restart stops the server with SIGINT and starts another on the same directory.
Nothing here asserts a time: figures are printed and compared side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import re
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.agent_traffic import (
    RequestRecord,
    TrafficConfig,
    plan_summary,
    plan_traffic,
    run_traffic,
)

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
#: Largest prompt of the full plan is about 18k tokens; room for the reply and the template.
MAX_MODEL_LEN = 32768
COMMON_ARGS = ["--model", "ds4", "--max-model-len", str(MAX_MODEL_LEN)]
#: A `vllm serve` start took 2-4 min at load averages of 40-80 on the shared 2-core machine
#: (the tests' 240 s default timed out once); a start that fails for a reason ends sooner.
START_TIMEOUT_S = 900.0
#: Optional parts other engineers add: module name under `benchmarks`, each with `run(dir, quick)`.
OPTIONAL_PARTS = ("model_scaling", "micro")
#: The issue's figures to show.
MIN_HIT_RATE = 0.95
MIN_DECODE_RATIO = 0.98

QUICK = TrafficConfig(
    conversations=3, rounds=4, restart_after_round=2, subagent_round=1, subagent_turns=2, one_off_every=4
)
FULL = TrafficConfig()


def _offloading_config(disk: Path) -> str:
    """vLLM's own offloading connector: the tiering spec (CPU tier + its file-system tier)."""
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": 1 << 30,
                "secondary_tiers": [{"type": "fs", "root_dir": str(disk)}],
            },
        }
    )


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    """One prefix-cache set-up: the `vllm serve` flags it adds for a checkpoint directory."""

    name: str
    description: str
    args: Callable[[Path], list[str]]


SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec(
            "ds4disk",
            "ds4disk connector + vLLM's in-memory prefix cache",
            lambda d: ["--kv-connector", "ds4disk", "--kv-disk-dir", str(d)],
        ),
        SystemSpec("memory", "vLLM's in-memory prefix cache only (no connector)", lambda d: []),
        SystemSpec(
            "single-session",
            "ds4 engine policy: ds4disk with no in-memory prefix cache, so only the running "
            "conversation is resident and every other one comes back from its evict file",
            lambda d: ["--kv-connector", "ds4disk", "--kv-disk-dir", str(d), "--no-enable-prefix-caching"],
        ),
        SystemSpec(
            "offloading",
            "vLLM OffloadingConnector (TieringOffloadingSpec: CPU + file-system tier)",
            lambda d: ["--kv-transfer-config", _offloading_config(d)],
        ),
    )
}


# ---------------------------------------------------------------------------- measuring helpers


class DiskSampler:
    """Samples a directory every `interval` s: peak bytes, every file name seen, names that vanished."""

    IGNORED = re.compile(r"(^|/)(\.ds4-vllm-usage\.lock|ds4-vllm-usage\.json)$|\.tmp")

    def __init__(self, directory: Path, interval: float = 0.2) -> None:
        self.directory = directory
        self.interval = interval
        self.peak_bytes = 0
        self.seen: dict[str, int] = {}  # path -> largest size seen
        self.current: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        total, names = 0, set()
        for root, _, files in os.walk(self.directory):
            for f in files:
                path = os.path.join(root, f)
                if self.IGNORED.search(path):
                    continue
                try:
                    size = os.stat(path).st_size
                except FileNotFoundError:
                    continue
                total += size
                names.add(path)
                self.seen[path] = max(size, self.seen.get(path, 0))
        self.current = names
        self.peak_bytes = max(self.peak_bytes, total)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def figures(self) -> dict[str, int]:
        return {
            "peak_disk_bytes": self.peak_bytes,
            "files_seen": len(self.seen),
            "files_at_end": len(self.current),
            "files_removed": len(set(self.seen) - self.current),
            "bytes_of_files_seen": sum(self.seen.values()),
        }


def scrape_counters(base_url: str) -> dict[str, float]:
    """`vllm:ds4disk_*` counters from /metrics, summed over label sets."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:ds4disk_") and "_created" not in line:
            name = re.split(r"[{ ]", line, maxsplit=1)[0].removeprefix("vllm:ds4disk_")
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def _ping(base_url: str) -> None:
    """A 1-token request under the checkpoint minimum: engine steps that report the writer's last stats."""
    body = json.dumps({"model": "ds4", "prompt": "ping", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def settled_counters(base_url: str) -> dict[str, float]:
    """Counters once the background writer has finished the phase's last saves."""
    for _ in range(2):
        time.sleep(1.0)
        _ping(base_url)
    return scrape_counters(base_url)


def error_lines(log: Path, limit: int = 6) -> list[str]:
    """The log lines that say why a server did not start (exceptions, errors)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    hits = [ln.strip() for ln in lines if re.search(r"(Error|Exception|raise |not supported)", ln)]
    return hits[-limit:]


# ---------------------------------------------------------------------------- one system


def run_system(spec: SystemSpec, config: TrafficConfig, work: Path, progress: Any = None) -> dict[str, Any]:
    """Run the whole plan against `spec`: server A, restart, server B. Raw records and counters."""
    from tests.e2e.server_process import ServerProcess

    disk = work / f"{spec.name}-cache"
    disk.mkdir(parents=True, exist_ok=True)
    args = COMMON_ARGS + spec.args(disk)
    servers: list[Any] = []
    counters: list[dict[str, float]] = []
    starts: list[float] = []

    def start(label: str) -> str:
        t0 = time.perf_counter()
        log = work / f"{spec.name}-{label}.log"
        try:
            server = ServerProcess(args, log).start(timeout=START_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            raise ServerStartError(spec.name, log, exc) from exc
        starts.append(time.perf_counter() - t0)
        servers.append(server)
        return server.base_url

    def stop_current() -> None:
        server = servers[-1]
        if server.proc is not None and server.proc.poll() is None:
            counters.append(settled_counters(server.base_url))
        server.stop()

    def restart() -> str:
        stop_current()
        return start("B")

    plan = plan_traffic(config)
    result: dict[str, Any] = {"system": spec.name, "description": spec.description, "args": args}
    try:
        base_url = start("A")
    except ServerStartError as exc:
        result["error"] = exc.summary()
        if progress is not None:
            progress.update(len(plan))
        return result
    records: list[RequestRecord] = []

    def after_request(record: RequestRecord) -> None:
        records.append(record)
        sampler.sample()

    with DiskSampler(disk) as sampler:
        try:
            run_traffic(
                base_url, plan, config, restart=restart, after_request=after_request, progress=progress
            )
            stop_current()
        except ServerStartError as exc:
            # keep what ran before the failed restart; the summary says the run is partial
            result["error"] = exc.summary()
            if progress is not None:
                progress.update(len(plan) - len(records))
        finally:
            for server in servers:
                server.stop()
    result.update(
        records=[dataclasses.asdict(r) for r in records],
        counters=_sum_counters(counters),
        disk=sampler.figures(),
        server_start_s=starts,
    )
    return result


class ServerStartError(RuntimeError):
    def __init__(self, system: str, log: Path, cause: Exception) -> None:
        super().__init__(f"{system}: vllm serve did not start ({log})")
        self.log, self.cause = log, cause

    def summary(self) -> dict[str, Any]:
        return {"message": str(self), "log": str(self.log), "error_lines": error_lines(self.log)}


def _sum_counters(per_server: list[dict[str, float]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for counters in per_server:  # each server's counters start at zero
        for key, value in counters.items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


# ---------------------------------------------------------------------------- figures


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _hit_rate(records: list[RequestRecord]) -> float | None:
    hit = sum(r.reused_tokens for r in records)
    total = sum(r.reused_tokens + _miss(r) for r in records)
    return hit / total if total else None


def _miss(r: RequestRecord) -> int:
    return r.miss_tokens if r.miss_tokens is not None else r.prompt_tokens - r.reused_tokens


def warm_up_indices(config: TrafficConfig) -> set[int]:
    """The first round: each main conversation's first request (only the system prompt is known)."""
    return {r.index for r in plan_traffic(config) if r.kind == "main" and r.turn == 1}


def new_tokens(records: list[RequestRecord], warm: set[int]) -> int:
    """Prompt tokens after warm-up that no cache could have held: text the server never saw.

    A turn's new tokens are those beyond its conversation's previous prompt and reply (the new
    tool results and user text, plus the few tokens where the reply is re-rendered); a one-off
    prompt is new as a whole; a later conversation's first request shares the warm-up requests'
    system prompt and tools, so only its part beyond the shortest warm-up prompt is new (which
    undercounts its task's few tokens). A lower bound on any cache's misses, within a few tokens
    per request.
    """
    shared = min((r.prompt_tokens for r in records if r.index in warm), default=0)
    previous: dict[str, RequestRecord] = {}
    total = 0
    for r in sorted(records, key=lambda r: r.index):
        before = previous.get(r.conversation)
        previous[r.conversation] = r
        if r.index in warm:
            continue
        if r.kind == "one-off":
            total += r.prompt_tokens
        elif before is None:
            total += max(0, r.prompt_tokens - shared)
        else:
            total += max(0, r.prompt_tokens - before.prompt_tokens - before.completion_tokens)
    return total


def first_after_restart(records: list[RequestRecord]) -> list[RequestRecord]:
    """Each conversation's first request on the restarted server (its reuse can only come from disk)."""
    seen_before = {r.conversation for r in records if r.phase == 0}
    firsts: dict[str, RequestRecord] = {}
    for r in records:
        if r.phase == 1 and r.conversation in seen_before and r.conversation not in firsts:
            firsts[r.conversation] = r
    return list(firsts.values())


def hit_rate_ceiling(records: list[RequestRecord], warm: set[int]) -> float | None:
    """The hit rate after warm-up of a cache that missed only `new_tokens`: the plan's ceiling."""
    total = sum(r.prompt_tokens for r in records if r.index not in warm)
    return 1 - new_tokens(records, warm) / total if total else None


def _ttft(records: list[RequestRecord]) -> dict[str, float | None]:
    values = [r.ttft_s for r in records]
    return {"median_s": _quantile(values, 0.5), "p90_s": _quantile(values, 0.9), "total_s": sum(values)}


def summarize(raw: dict[str, Any], config: TrafficConfig) -> dict[str, Any]:
    """Per-system figures from its raw records, counters and disk samples."""
    if "records" not in raw or not raw["records"]:
        return {"error": raw["error"]}
    records = [RequestRecord(**r) for r in raw["records"]]
    warm = warm_up_indices(config)
    after_warm = [r for r in records if r.index not in warm]
    restart_firsts = first_after_restart(records)
    reused = sum(r.reused_tokens for r in records)
    counters = raw.get("counters", {})
    decode = [r.decode_tokens_per_s for r in records if r.decode_tokens_per_s]
    usage_fields = {
        "cached_tokens": all(r.cached_tokens is not None for r in records),
        "prompt_cache_hit_tokens": all(r.hit_tokens is not None for r in records),
        "prompt_cache_miss_tokens": all(r.miss_tokens is not None for r in records),
        "hit_plus_miss_is_prompt": all(
            r.hit_tokens is not None and r.hit_tokens + _miss(r) == r.prompt_tokens for r in records
        ),
    }
    bytes_written = counters.get("bytes_written_total", 0.0)
    bytes_read = counters.get("bytes_read_total", 0.0)
    partial = (
        {"error": raw["error"], "partial": "only the requests before the error ran"} if "error" in raw else {}
    )
    return {
        **partial,
        "requests": len(records),
        "ttft": _ttft(records),
        "ttft_after_warm_up": _ttft(after_warm),
        "ttft_phase": {str(ph): _ttft([r for r in records if r.phase == ph]) for ph in (0, 1)},
        "ttft_first_after_restart": _ttft(restart_firsts),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "computed_tokens": sum(_miss(r) for r in records),
        "reused_tokens": reused,
        "disk_tokens": sum(r.disk_tokens or 0 for r in records),
        "hit_rate": _hit_rate(records),
        "hit_rate_after_warm_up": _hit_rate(after_warm),
        "hit_rate_ceiling_after_warm_up": hit_rate_ceiling(records, warm),
        "hit_rate_phase": {str(ph): _hit_rate([r for r in records if r.phase == ph]) for ph in (0, 1)},
        "hit_rate_first_after_restart": _hit_rate(restart_firsts),
        "disk_bytes_written": bytes_written,
        "disk_bytes_read": bytes_read,
        "bytes_written_per_reused_token": bytes_written / reused if reused else None,
        "bytes_read_per_reused_token": bytes_read / reused if reused else None,
        "files_evicted_budget": counters.get("files_evicted_total", 0.0),
        **raw.get("disk", {}),
        "decode_tokens_per_s_median": _quantile(decode, 0.5),
        "usage_fields_present": usage_fields,
        "server_start_s": raw.get("server_start_s"),
        "counters": counters,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def checks(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's 'must show' items for agent traffic, each with its measured figures."""
    disk, mem, single = (summaries.get(k, {}) for k in ("ds4disk", "memory", "single-session"))
    out: dict[str, Any] = {}

    def ok(*values: Any) -> bool:
        return all(v is not None for v in values)

    if ok(disk.get("hit_rate_after_warm_up")):
        out["ds4disk_hit_rate_after_warm_up"] = {
            "value": disk["hit_rate_after_warm_up"],
            "goal": f">= {MIN_HIT_RATE}",
            "ceiling_of_the_plan": disk.get("hit_rate_ceiling_after_warm_up"),
            "met": disk["hit_rate_after_warm_up"] >= MIN_HIT_RATE,
        }
    if "ttft" in disk and "ttft" in mem and "error" not in mem and "error" not in disk:
        a, b = disk["ttft_phase"]["1"]["median_s"], mem["ttft_phase"]["1"]["median_s"]
        c, d = disk["ttft_first_after_restart"]["median_s"], mem["ttft_first_after_restart"]["median_s"]
        out["beats_memory_across_restart"] = {
            "ttft_median_after_restart_ratio_memory_over_ds4disk": _ratio(b, a),
            "first_turn_after_restart_ratio_memory_over_ds4disk": _ratio(d, c),
            "met": ok(a, b, c, d) and a < b and c < d,
        }
        dec = _ratio(disk["decode_tokens_per_s_median"], mem["decode_tokens_per_s_median"])
        out["decode_ds4disk_over_memory"] = {
            "value": dec,
            "goal": f">= {MIN_DECODE_RATIO}",
            "met": dec is not None and dec >= MIN_DECODE_RATIO,
        }
    if "ttft" in disk and "ttft" in single and "error" not in single and "error" not in disk:
        # Both the typical turn (median) and the whole phase (the sum, where the slow turns
        # count too) must be faster, before and after the restart.
        medians, totals = (
            {ph: _ratio(single["ttft_phase"][ph][key], disk["ttft_phase"][ph][key]) for ph in ("0", "1")}
            for key in ("median_s", "total_s")
        )
        a, b = disk["bytes_written_per_reused_token"], single["bytes_written_per_reused_token"]
        out["beats_single_session_throughout"] = {
            "ttft_median_ratio_single_over_ds4disk_by_phase": medians,
            "ttft_total_ratio_single_over_ds4disk_by_phase": totals,
            "met": all(v is not None and v > 1 for v in [*medians.values(), *totals.values()]),
        }
        out["fewer_bytes_written_per_reused_token_than_single_session"] = {
            "ds4disk": a,
            "single_session": b,
            "met": ok(a, b) and a < b,
        }
    return out


# ---------------------------------------------------------------------------- output


def plot(raw: dict[str, dict[str, Any]], config: TrafficConfig, out: Path) -> list[str]:
    """TTFT by request and cumulative hit rate for every system that ran; the restart marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {k: [RequestRecord(**r) for r in v["records"]] for k, v in raw.items() if "records" in v}
    if not ran:
        return []
    restart_at = next((r.index for r in plan_traffic(config) if r.phase == 1), None)
    files = []
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, records in ran.items():
        ax.plot([r.index for r in records], [r.ttft_s for r in records], marker="o", ms=3, label=name)
    if restart_at is not None:
        ax.axvline(restart_at - 0.5, color="grey", ls="--", label="restart")
    ax.set_yscale("log")
    ax.set_xlabel("request (plan order)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Agent traffic: time to first token per request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_by_request.png", dpi=110)
    plt.close(fig)
    files.append("ttft_by_request.png")

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, records in ran.items():
        hit = total = 0
        xs, ys = [], []
        for r in records:
            hit += r.reused_tokens
            total += r.reused_tokens + _miss(r)
            xs.append(r.index)
            ys.append(hit / total if total else 0.0)
        ax.plot(xs, ys, marker=".", label=f"{name} (cumulative)")
    if restart_at is not None:
        ax.axvline(restart_at - 0.5, color="grey", ls="--", label="restart")
    ax.axhline(MIN_HIT_RATE, color="black", lw=0.7, ls=":", label=f"{MIN_HIT_RATE}")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("request (plan order)")
    ax.set_ylabel("hit / (hit + miss)")
    ax.set_title("Agent traffic: prompt-cache hit rate over the run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)
    files.append("hit_rate.png")
    return files


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        if abs(v) >= 1e6:
            return f"{v / 2**20:.1f} MiB"
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def markdown(report: dict[str, Any]) -> str:
    summaries = report["agent_traffic"]["systems"]
    ran = {k: v for k, v in summaries.items() if "requests" in v}
    rows = [
        ("TTFT median / p90 (s)", lambda s: f"{_cell(s['ttft']['median_s'])} / {_cell(s['ttft']['p90_s'])}"),
        (
            "TTFT median after restart (s)",
            lambda s: _cell(s["ttft_phase"]["1"]["median_s"]),
        ),
        ("TTFT, first turn after restart (s)", lambda s: _cell(s["ttft_first_after_restart"]["median_s"])),
        ("prompt tokens computed / reused", lambda s: f"{s['computed_tokens']} / {s['reused_tokens']}"),
        ("  of them from disk", lambda s: str(s["disk_tokens"])),
        (
            "hit rate (all / after warm-up)",
            lambda s: f"{_cell(s['hit_rate'])} / {_cell(s['hit_rate_after_warm_up'])}",
        ),
        ("  the plan's ceiling after warm-up", lambda s: _cell(s["hit_rate_ceiling_after_warm_up"])),
        ("hit rate, first turn after restart", lambda s: _cell(s["hit_rate_first_after_restart"])),
        (
            "disk bytes written / read",
            lambda s: f"{_cell(s['disk_bytes_written'])} / {_cell(s['disk_bytes_read'])}",
        ),
        (
            "bytes written / read per reused token",
            lambda s: (
                f"{_cell(s['bytes_written_per_reused_token'])} / {_cell(s['bytes_read_per_reused_token'])}"
            ),
        ),
        (
            "files written / removed (budget evictions)",
            lambda s: f"{s['files_seen']} / {s['files_removed']} ({_cell(s['files_evicted_budget'])})",
        ),
        ("peak disk use", lambda s: _cell(float(s["peak_disk_bytes"]))),
        ("decode tokens/s (median)", lambda s: _cell(s["decode_tokens_per_s_median"])),
    ]
    traffic = report["agent_traffic"]
    lines = [
        f"# Benchmark report {report['date']} ({report['mode']})",
        "",
        f"Machine: {report['machine'].get('cpu_count')} CPUs, load average "
        f"{report['load_average_start']} at start, {report['load_average_end']} at end; "
        f"vllm {report['machine'].get('versions', {}).get('vllm')}, torch "
        f"{report['machine'].get('versions', {}).get('torch')}.",
        "",
        "## Agent traffic",
        "",
        f"Plan (seed {traffic['config']['seed']}): {json.dumps(traffic['plan'])}.",
        "Warm-up = each main conversation's first request. Ratios are within this one run.",
        "",
        "| figure | " + " | ".join(ran) + " |",
        "|---|" + "---|" * len(ran),
    ]
    lines += [f"| {label} | " + " | ".join(fn(s) for s in ran.values()) + " |" for label, fn in rows]
    lines.append("")
    for name, s in summaries.items():
        if "error" in s:
            what = "stopped early (partial figures above)" if "requests" in s else "did not run"
            lines.append(f"**{name}** {what}: {s['error']['message']}")
            lines += [f"    {ln}" for ln in s["error"]["error_lines"]]
            lines.append("")
    lines += ["### Goals", "", "| goal | measured | met |", "|---|---|---|"]
    for goal, figures in traffic["checks"].items():
        measured = {k: v for k, v in figures.items() if k != "met"}
        shown = ", ".join(
            f"{k}={_cell(v) if not isinstance(v, dict) else {kk: _cell(vv) for kk, vv in v.items()}}"
            for k, v in measured.items()
        )
        lines.append(f"| {goal} | {shown} | {_cell(figures['met'])} |")
    lines += ["", *[f"![{p}]({p})" for p in traffic["plots"]], ""]
    for name, part in report["parts"].items():
        lines += part_markdown(name, part)
    return "\n".join(lines)


def part_markdown(name: str, part: dict[str, Any]) -> list[str]:
    """An optional part's section: its own tables (``table_markdown``) and ``plots``, or why it was skipped."""
    lines = [f"## {name}", ""]
    if "skipped" in part:
        return [*lines, f"Skipped: {part['skipped']}", ""]
    if part.get("table_markdown"):
        lines += [part["table_markdown"], ""]
    lines += [f"![{p}]({p})" for p in part.get("plots", [])]
    return [*lines, ""]


def run_parts(
    results_dir: Path,
    quick: bool,
    names: tuple[str, ...] = OPTIONAL_PARTS,
    options: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Each optional part's `run(results_dir, quick, **options[name])` dict, or a note why it was skipped."""
    parts: dict[str, Any] = {}
    for name in names:
        try:
            module = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as exc:
            parts[name] = {"skipped": f"benchmarks/{name}.py not present ({exc.name})"}
            continue
        if not hasattr(module, "run"):
            parts[name] = {"skipped": f"benchmarks/{name}.py has no run(results_dir, quick)"}
            continue
        try:
            parts[name] = module.run(results_dir, quick, **(options or {}).get(name, {}))
        except Exception as exc:  # a failing part must not lose the rest of the report
            parts[name] = {"skipped": f"failed: {exc!r}", "traceback": traceback.format_exc()}
    return parts


def run_report(
    results_dir: Path,
    config: TrafficConfig,
    *,
    mode: str,
    systems: list[str],
    parts: bool,
    work: Path | None = None,
    part_options: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run the traffic against `systems` (and the optional parts); write the JSON, Markdown, PNGs."""
    import tempfile

    from tqdm import tqdm

    from benchmarks.reporting import machine_info

    results_dir.mkdir(parents=True, exist_ok=True)
    plan = plan_traffic(config)
    load_start = os.getloadavg()[0]
    raw: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ds4-bench-") as tmp:
        work = work or Path(tmp)
        with tqdm(total=len(plan) * len(systems), desc="agent traffic", unit="req") as progress:
            for name in systems:
                progress.set_postfix_str(name)
                raw[name] = run_system(SYSTEMS[name], config, work, progress)
    summaries = {name: summarize(r, config) for name, r in raw.items()}
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "mode": mode,
        "machine": machine_info(),
        "load_average_start": round(load_start, 2),
        "agent_traffic": {
            "config": dataclasses.asdict(config),
            "plan": plan_summary(plan),
            "systems": summaries,
            "checks": checks(summaries),
            "plots": plot(raw, config, results_dir),
            "requests": {name: r.get("records", []) for name, r in raw.items()},
        },
        "parts": run_parts(results_dir, quick=mode != "full", options=part_options) if parts else {},
    }
    report["load_average_end"] = round(os.getloadavg()[0], 2)
    for r in report["agent_traffic"]["requests"].values():
        for rec in r:
            rec.pop("reply", None)  # random text of a random model: noise in the file
    (results_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (results_dir / "report.md").write_text(markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("quick", "full"))
    parser.add_argument(
        "--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS)
    )  # run in this order
    parser.add_argument("--no-parts", action="store_true", help="skip the optional parts")
    parser.add_argument("--out", type=Path, help="results folder (default results/<date>)")
    parser.add_argument("--seed", type=int, help="traffic seed (default 11)")
    parser.add_argument(
        "--work", type=Path, help="keep server logs and cache folders here (default: a temp dir)"
    )
    parser.add_argument(
        "--restart-model",
        help='model of micro\'s restart part (default: "slice" in full, "ds4" in quick); '
        '"slice:N" for N routed experts, or "ds4" where the real-width slice cannot run',
    )
    args = parser.parse_args(argv)
    config = QUICK if args.mode == "quick" else FULL
    if args.seed is not None:
        config = dataclasses.replace(config, seed=args.seed)
    out = args.out or RESULTS_ROOT / datetime.date.today().isoformat()
    part_options = {"micro": {"restart_model": args.restart_model}} if args.restart_model else None
    report = run_report(
        out,
        config,
        mode=args.mode,
        systems=args.systems,
        parts=not args.no_parts,
        work=args.work,
        part_options=part_options,
    )
    print((out / "report.md").read_text())
    print(f"wrote {out}/report.json, report.md and plots")
    return 0 if report else 1


if __name__ == "__main__":
    raise SystemExit(main())
