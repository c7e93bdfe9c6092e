"""Run fuzz targets one after another, each in its own process, and summarize what libFuzzer saw.

    python -m tests.fuzz.campaign [TARGET ...] --runs N [--seed S] [--out DIR] [--json FILE]

Prints one line per target (cases, cases/s, crashes, coverage) and writes the summary as JSON.
Exit status 1 when any target found a crashing input (kept as DIR/TARGET/crash-*).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .targets import SCRATCH_ENV, TARGETS, scratch_base

REPO_ROOT = Path(__file__).resolve().parents[2]
_STAT = re.compile(r"^stat::(\w+):\s+(\d+)", re.M)
_COV = re.compile(r"\bcov: (\d+) ft: (\d+)")


@dataclasses.dataclass
class TargetRun:
    target: str
    runs_asked: int
    cases: int
    seconds: float
    cases_per_s: float
    crashes: list[str]
    coverage: int
    features: int
    returncode: int
    log: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.crashes and self.cases >= self.runs_asked


def run_target(target: str, runs: int, work: Path, *, seed: int = 1, timeout_s: float = 3600) -> TargetRun:
    """One target in a subprocess (atheris exits its process when done)."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "fuzz.log"
    # libFuzzer ends its process without Python's atexit, so the targets' scratch folders are made
    # in one this process owns and removes.
    scratch = tempfile.TemporaryDirectory(prefix=f"ds4-fuzz-{target}-", dir=scratch_base())
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), SCRATCH_ENV: scratch.name}
    started = time.monotonic()
    with scratch, open(log, "wb") as fp:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.fuzz.run",
                target,
                f"--runs={runs}",
                f"--seed={seed}",
                f"--work={work}",
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=fp,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    seconds = time.monotonic() - started
    text = log.read_text(errors="replace")
    stats = {k: int(v) for k, v in _STAT.findall(text)}
    cov = _COV.findall(text)
    cases = stats.get("number_of_executed_units", 0)
    return TargetRun(
        target=target,
        runs_asked=runs,
        cases=cases,
        seconds=round(seconds, 1),
        cases_per_s=round(cases / seconds, 1) if seconds else 0.0,
        crashes=sorted(str(p) for p in work.glob("crash-*")) + sorted(str(p) for p in work.glob("timeout-*")),
        coverage=int(cov[-1][0]) if cov else 0,
        features=int(cov[-1][1]) if cov else 0,
        returncode=proc.returncode,
        log=str(log),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fuzz.campaign", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "targets", nargs="*", default=list(TARGETS), help=f"default: all ({', '.join(TARGETS)})"
    )
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here too")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="ds4-fuzz-campaign-"))
    results = []
    for target in args.targets:
        r = run_target(target, args.runs, out / target, seed=args.seed)
        results.append(r)
        print(
            f"{r.target:<11} cases={r.cases:>8} seconds={r.seconds:>7.1f} cases/s={r.cases_per_s:>7.1f} "
            f"cov={r.coverage:>4} ft={r.features:>5} crashes={len(r.crashes)} rc={r.returncode}",
            flush=True,
        )
        for crash in r.crashes:
            print(f"  crash input: {crash} (log {r.log})", flush=True)
    summary = {
        "runs_per_target": args.runs,
        "seed": args.seed,
        "targets": [dataclasses.asdict(r) for r in results],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    total = sum(r.cases for r in results)
    print(
        f"total cases={total} crashes={sum(len(r.crashes) for r in results)} summary={out / 'summary.json'}"
    )
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
