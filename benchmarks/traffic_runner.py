"""Running the planned agent traffic against one prefix-cache set-up: `vllm serve` processes on
loopback (started, restarted with SIGINT, stopped), their counters and disk use sampled."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.agent_traffic import (
    RequestRecord,
    TrafficConfig,
    plan_traffic,
    run_traffic,
)

#: Largest prompt of the full plan is about 18k tokens; room for the reply and the template.
MAX_MODEL_LEN = 32768
COMMON_ARGS = ["--model", "ds4", "--max-model-len", str(MAX_MODEL_LEN)]
#: A `vllm serve` start took 2-4 min at load averages of 40-80 on the shared 2-core machine
#: (the tests' 240 s default timed out once); a start that fails for a reason ends sooner.
START_TIMEOUT_S = 900.0


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
        SystemSpec(
            "ds4disk-ds4-policy",
            "ds4disk with ds4's save points only (--kv-cache-divergence-tokens 0: no agent-system "
            "saves where a prompt's set-up parts from a known one's)",
            lambda d: [
                "--kv-connector",
                "ds4disk",
                "--kv-disk-dir",
                str(d),
                "--kv-cache-divergence-tokens",
                "0",
            ],
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


# ---------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class DiskFigures:
    """What the checkpoint directory held over one system's run (sampled every 0.2 s)."""

    peak_disk_bytes: int = 0
    files_seen: int = 0
    files_at_end: int = 0
    files_removed: int = 0
    bytes_of_files_seen: int = 0


@dataclasses.dataclass(frozen=True)
class StartFailure:
    """Why a server of the run did not start: the message, its log and the log's error lines."""

    message: str
    log: str
    error_lines: list[str]


@dataclasses.dataclass
class SystemRun:
    """One system's raw results: every request's record, the servers' summed counters, the disk.

    `error` is set when a server did not start; the records are then those that ran before it.
    """

    system: str
    description: str
    args: list[str]
    records: list[RequestRecord] = dataclasses.field(default_factory=list)
    counters: dict[str, float] = dataclasses.field(default_factory=dict)
    disk: DiskFigures = dataclasses.field(default_factory=DiskFigures)
    server_start_s: list[float] = dataclasses.field(default_factory=list)
    error: StartFailure | None = None


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

    def figures(self) -> DiskFigures:
        return DiskFigures(
            peak_disk_bytes=self.peak_bytes,
            files_seen=len(self.seen),
            files_at_end=len(self.current),
            files_removed=len(set(self.seen) - self.current),
            bytes_of_files_seen=sum(self.seen.values()),
        )


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


def run_system(spec: SystemSpec, config: TrafficConfig, work: Path, progress: Any = None) -> SystemRun:
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
    result = SystemRun(spec.name, spec.description, args, server_start_s=starts)
    try:
        base_url = start("A")
    except ServerStartError as exc:
        result.error = exc.summary()
        if progress is not None:
            progress.update(len(plan))
        return result

    def after_request(record: RequestRecord) -> None:
        result.records.append(record)
        sampler.sample()

    with DiskSampler(disk) as sampler:
        try:
            run_traffic(
                base_url, plan, config, restart=restart, after_request=after_request, progress=progress
            )
            stop_current()
        except ServerStartError as exc:
            # keep what ran before the failed restart; the summary says the run is partial
            result.error = exc.summary()
            if progress is not None:
                progress.update(len(plan) - len(result.records))
        finally:
            for server in servers:
                server.stop()
    result.counters = _sum_counters(counters)
    result.disk = sampler.figures()
    return result


class ServerStartError(RuntimeError):
    def __init__(self, system: str, log: Path, cause: Exception) -> None:
        super().__init__(f"{system}: vllm serve did not start ({log})")
        self.log, self.cause = log, cause

    def summary(self) -> StartFailure:
        return StartFailure(str(self), str(self.log), error_lines(self.log))


def _sum_counters(per_server: list[dict[str, float]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for counters in per_server:  # each server's counters start at zero
        for key, value in counters.items():
            totals[key] = totals.get(key, 0.0) + value
    return totals
