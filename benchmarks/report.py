"""One benchmark report (issue 11): agent traffic against four prefix-cache set-ups, plus optional parts.

    python -m benchmarks.report quick    # 3 conversations, 4 rounds (35 min at load 50-80, 8 server starts)
    python -m benchmarks.report full     # 4 conversations, 24 rounds (107 requests per system)
    python -m benchmarks.report quick --systems ds4disk memory --no-parts
    python -m benchmarks.report quick --scenario folders --no-parts   # sessions in their own folders

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
import traceback
from pathlib import Path
from typing import Any

from benchmarks.agent_traffic import (
    TrafficConfig,
    plan_summary,
    plan_traffic,
)
from benchmarks.report_data import AgentTrafficResult, Report
from benchmarks.traffic_render import markdown, plot
from benchmarks.traffic_runner import SYSTEMS, SystemRun, run_system
from benchmarks.traffic_stats import summarize
from benchmarks.traffic_verdicts import checks

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
#: Optional parts other engineers add: module name under `benchmarks`, each with `run(dir, quick)`.
OPTIONAL_PARTS = ("model_scaling", "micro")
QUICK = TrafficConfig(
    conversations=3, rounds=4, restart_after_round=2, subagent_round=1, subagent_turns=2, one_off_every=4
)
FULL = TrafficConfig()
#: The set-ups each scenario compares: the folders one sets ds4disk beside its policy before
#: divergence saves (issue 21) and vLLM's memory-only cache.
DEFAULT_SYSTEMS = {
    "agents": ["ds4disk", "memory", "single-session", "offloading"],
    "folders": ["ds4disk", "ds4disk-ds4-policy", "memory"],
}


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
) -> Report:
    """Run the traffic against `systems` (and the optional parts); write the JSON, Markdown, PNGs."""
    import tempfile

    from tqdm import tqdm

    from benchmarks.reporting import machine_info

    results_dir.mkdir(parents=True, exist_ok=True)
    plan = plan_traffic(config)
    load_start = os.getloadavg()[0]
    raw: dict[str, SystemRun] = {}
    with tempfile.TemporaryDirectory(prefix="ds4-bench-") as tmp:
        work = work or Path(tmp)
        with tqdm(total=len(plan) * len(systems), desc="agent traffic", unit="req") as progress:
            for name in systems:
                progress.set_postfix_str(name)
                raw[name] = run_system(SYSTEMS[name], config, work, progress)
    summaries = {name: summarize(r, config) for name, r in raw.items()}
    traffic = AgentTrafficResult(
        config=config,
        plan=plan_summary(plan),
        systems=summaries,
        checks=checks(summaries),
        plots=plot(raw, config, results_dir),
        requests={name: r.records for name, r in raw.items()},
    )
    parts_run = run_parts(results_dir, quick=mode != "full", options=part_options) if parts else {}
    report = Report(
        date=datetime.date.today().isoformat(),
        mode=mode,
        machine=machine_info(),
        load_average_start=round(load_start, 2),
        load_average_end=round(os.getloadavg()[0], 2),
        agent_traffic=traffic,
        parts=parts_run,
    )
    (results_dir / "report.json").write_text(json.dumps(report.to_json(), indent=1) + "\n")
    (results_dir / "report.md").write_text(markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("quick", "full"))
    parser.add_argument(
        "--systems", nargs="+", choices=list(SYSTEMS), help="run in this order (default: per scenario)"
    )
    parser.add_argument("--no-parts", action="store_true", help="skip the optional parts")
    parser.add_argument("--out", type=Path, help="results folder (default results/<date>)")
    parser.add_argument("--seed", type=int, help="traffic seed (default 11)")
    parser.add_argument(
        "--scenario",
        choices=("agents", "folders"),
        default="agents",
        help="folders: each session in its own folder, named late in its system prompt (issue 21)",
    )
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
    if args.scenario == "folders":
        config = dataclasses.replace(config, folders=True)
    systems = args.systems or DEFAULT_SYSTEMS[args.scenario]
    out = args.out or RESULTS_ROOT / datetime.date.today().isoformat()
    part_options = {"micro": {"restart_model": args.restart_model}} if args.restart_model else None
    report = run_report(
        out,
        config,
        mode=args.mode,
        systems=systems,
        parts=not args.no_parts,
        work=args.work,
        part_options=part_options,
    )
    print((out / "report.md").read_text())
    print(f"wrote {out}/report.json, report.md and plots")
    return 0 if report.agent_traffic.requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
