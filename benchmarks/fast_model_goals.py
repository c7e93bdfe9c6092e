"""Issue 19's goals measured in one run, one table: each benchmark in its own process, one after another.

    .venv/bin/python -m benchmarks.fast_model_goals --engine-src /path/to/antirez-ds4
    .venv/bin/python -m benchmarks.fast_model_goals --only tables --results-dir DIR   # the table again

Runs, into one folder (``--results-dir``, default ``benchmarks/results/<YYYY-MM-DD>-goals/``):

1. ``decode_tiny``: `decode_step.py` on the tiny default (bf16, batch 1 and 8, vLLM's CPU
   kernels and the portable reference, ``--profile``): the batch-1 step over the time to read
   its active weights, batch 8 over batch 1, the top operators of a batch-1 step on the
   reference path and on the fast path;
2. ``decode_slice``: `decode_step.py` on the real-width slice (q2 weights, float32, batch 1);
3. ``compiled``: `compiled_decode.py` (bf16): the compiled engine against `enforce_eager`,
   its start-up with cold and warm compile caches, the tokens of both;
4. ``quantized``: `quantized_speed.py` on ``ds4-tiny-q2`` against its float32 twin;
5. ``engine``: `engine_compare.py` against the ds4 engine built from ``--engine-src`` (skipped
   without it): 2k prefill, batch-1 decode at 2k, our peak resident memory over the file.

Then writes ``fast_model_goals.json`` and ``fast_model_goals.md`` (the goals with their measured
ratios, the profiles) from the files in that folder. Each step prints the machine's load; run
it on an otherwise idle machine (about 30-35 minutes on the 2-core machine, 15 of them the ds4
engine's 2k prefill). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.reporting import RESULTS_DIR, child_env, machine_info, module_command, print_table, write_json

STEPS = ("decode_tiny", "decode_slice", "compiled", "quantized", "engine")
FILES = {
    "decode_tiny": "decode_step.json",
    "decode_slice": "decode_step_slice.json",
    "compiled": "compiled_decode.json",
    "quantized": "quantized_speed.json",
    "engine": "engine_compare.json",
}


def step_command(step: str, folder: Path, engine_src: Path | None) -> list[str] | None:
    """The command line of one step (None: the step cannot run, e.g. no engine checkout)."""
    out = ["--results-dir", str(folder)]
    if step == "decode_tiny":
        return module_command(
            "benchmarks.decode_step", "--dtype", "bfloat16", "--kernels", "vllm", "torch", "--profile", *out
        )
    if step == "decode_slice":
        return module_command(
            "benchmarks.decode_step",
            *("--model", "slice", "--dtype", "float32", "--batch", "1", "--kernels", "vllm"),
            *("--steps", "5", *out),
        )
    if step == "compiled":
        return module_command("benchmarks.compiled_decode", "--dtype", "bfloat16", *out)
    if step == "quantized":
        output = str(folder / FILES["quantized"])
        return module_command(
            "benchmarks.quantized_speed", "--quant", "q2", "--prefill", "512", "--output", output
        )
    if step == "engine":
        return (
            None
            if engine_src is None
            else module_command("benchmarks.engine_compare", "--engine-src", str(engine_src), *out)
        )
    raise ValueError(f"unknown step {step!r}")


@dataclasses.dataclass(frozen=True)
class Goal:
    """One of issue 19's goals as this run measured it (``ratio`` None: not measured)."""

    goal: str
    target: str
    ratio: float | None
    unit: str
    met: bool | None
    detail: str
    source: str

    @property
    def measured(self) -> str:
        if self.ratio is None:
            return ""
        if self.unit == "yes/no":
            return "yes" if self.ratio else "no"
        return f"{self.ratio:+.1f} s" if self.unit == "s" else f"{self.ratio:.2f}x"


def _row(decode: dict[str, Any], dtype: str, batch: int) -> dict[str, Any]:
    for row in decode["rows"]:
        if row["dtype"] == dtype and row["kernels"] == "vllm" and row["batch"] == batch:
            return row
    raise KeyError(f"no {dtype} batch-{batch} row with vLLM's kernels")


def _median_ms(run: dict[str, Any], batch: int) -> float:
    return statistics.median(run["decode_ms"][str(batch)])


def goals(results: dict[str, dict[str, Any]]) -> list[Goal]:
    """Issue 19's goals from the steps' result files (keyed as `FILES`); missing steps: not measured."""
    out: list[Goal] = []

    def add(
        step: str,
        goal: str,
        target: str,
        at_most: bool,
        limit: float,
        measure: Callable[[dict[str, Any]], tuple[float, str]],
        unit: str = "x",
    ) -> None:
        data = results.get(step)
        if data is None:
            out.append(Goal(goal, target, None, unit, None, "not measured in this run", FILES[step]))
            return
        ratio, detail = measure(data)
        met = ratio <= limit if at_most else ratio >= limit
        out.append(Goal(goal, target, ratio, unit, met, detail, FILES[step]))

    def step_over_read(data: dict[str, Any], dtype: str) -> tuple[float, str]:
        row = _row(data, dtype, 1)
        return row["step_over_read"], (
            f"{row['ms_per_step']:.1f} ms against {row['read_ms']:.1f} ms to read "
            f"{row['active_weight_bytes'] / 1e6:.0f} MB at {data['read_bandwidth_gb_s']:.1f} GB/s"
        )

    add(
        "decode_tiny",
        "batch-1 step over its active weights' read time, tiny default (bf16)",
        "<= 2x",
        True,
        2.0,
        lambda d: step_over_read(d, "bfloat16"),
    )
    add(
        "decode_slice",
        "the same on the real-width slice (q2)",
        "<= 2x",
        True,
        2.0,
        lambda d: step_over_read(d, "float32"),
    )

    def compiled_speedup(data: dict[str, Any], batch: int) -> tuple[float, str]:
        runs = data["runs"]
        eager = statistics.median(
            runs["eager"]["decode_ms"][str(batch)] + runs["eager again"]["decode_ms"][str(batch)]
        )
        compiled = _median_ms(runs["compiled, warm caches"], batch)
        return eager / compiled, f"{compiled:.1f} ms compiled (warm caches) against {eager:.1f} ms eager"

    add(
        "compiled",
        "compiled batch-1 decode over enforce_eager",
        ">= 2.5x",
        False,
        2.5,
        lambda d: compiled_speedup(d, 1),
    )
    add(
        "compiled",
        "compiled batch-8 decode over enforce_eager",
        ">= 2x",
        False,
        2.0,
        lambda d: compiled_speedup(d, 8),
    )

    def batching(data: dict[str, Any]) -> tuple[float, str]:
        run = data["runs"]["compiled, warm caches"]
        ms1, ms8 = _median_ms(run, 1), _median_ms(run, 8)
        detail = f"compiled engine: batch 8 {8e3 / ms8:.0f} tok/s, batch 1 {1e3 / ms1:.0f} tok/s"
        if "decode_tiny" in results:  # the model alone, without vLLM's step around it
            alone = _row(results["decode_tiny"], "bfloat16", 8)["throughput_over_batch1"]
            detail += f"; the model alone (decode_step.json, eager): {alone:.2f}x"
        return 8 * ms1 / ms8, detail

    add("compiled", "batch-8 decode tokens/s over batch 1", ">= 4x", False, 4.0, batching)

    def eager_start(data: dict[str, Any]) -> float:
        runs = data["runs"]
        return statistics.median([runs["eager"]["start_s"], runs["eager again"]["start_s"]])

    def start_over_eager(data: dict[str, Any], name: str) -> tuple[float, str]:
        extra = data["runs"][name]["start_s"] - eager_start(data)
        return extra, f"{data['runs'][name]['start_s']:.1f} s against {eager_start(data):.1f} s eager"

    add(
        "compiled",
        "cold start's compilation (s more than eager)",
        "<= 120 s",
        True,
        120.0,
        lambda d: start_over_eager(d, "compiled, cold caches"),
        "s",
    )
    add(
        "compiled",
        "warm start (s more than eager)",
        "<= 20 s",
        True,
        20.0,
        lambda d: start_over_eager(d, "compiled, warm caches"),
        "s",
    )

    def same_tokens(data: dict[str, Any]) -> tuple[float, str]:
        eager, compiled = data["runs"]["eager"]["tokens"], data["runs"]["compiled, warm caches"]["tokens"]
        first = [
            next((step for step, (a, b) in enumerate(zip(e, c, strict=True)) if a != b), None)
            for e, c in zip(eager, compiled, strict=True)
        ]
        parted = sorted(step for step in first if step is not None)
        where = f"; they part at steps {', '.join(map(str, parted))}" if parted else ""
        return float(data["same_tokens"]), (
            f"tiny default, bf16, greedy: {len(parted)} of {len(first)} requests of "
            f"{len(eager[0])} tokens differ{where} (tests/model/test_compiled.py allows it at eager's near-ties)"
        )

    add("compiled", "compiled and eager give the same tokens", "yes", False, 1.0, same_tokens, "yes/no")

    def packed_speed(data: dict[str, Any]) -> tuple[float, str]:
        q2 = data["results"]["q2"]
        ratios = {
            b: q2["gguf"]["decode"][b]["tokens_per_s"] / q2["float"]["decode"][b]["tokens_per_s"]
            for b in q2["gguf"]["decode"]
        }
        return ratios["1"], (f"batch 8: {ratios['8']:.2f}x" if "8" in ratios else "")

    add("quantized", "ds4-tiny-q2 batch-1 decode over its float32 twin", ">= 0.9x", False, 0.9, packed_speed)

    def engine_ratio(data: dict[str, Any], key: str) -> tuple[float, str]:
        ours, engine, context = data["ours"], data["engine"], data["settings"]["context"]
        if key == "prefill":
            theirs = context / engine["prefill_tokens_per_s"]
            return ours[
                "prefill_s"
            ] / theirs, f"{ours['prefill_s']:.1f} s against the engine's {theirs:.1f} s"
        if key == "decode":
            theirs = 1e3 / engine["decode_tokens_per_s"]
            return ours[
                "decode_step_ms"
            ] / theirs, f"{ours['decode_step_ms']:.0f} ms against the engine's {theirs:.0f} ms"
        peak = ours["peak_rss_bytes"]
        return peak / data["file_bytes"], (
            f"{peak / 2**30:.2f} GiB for a {data['file_bytes'] / 2**30:.2f} GiB file "
            f"(the engine: {engine['peak_rss_bytes'] / 2**30:.2f} GiB)"
        )

    add(
        "engine",
        "slice peak resident memory over the GGUF's size (2k prefill and decode)",
        "<= 1.3x",
        True,
        1.3,
        lambda d: engine_ratio(d, "memory"),
    )
    add(
        "engine",
        "slice batch-1 decode at 2k over the ds4 engine's",
        "<= 1.0x",
        True,
        1.0,
        lambda d: engine_ratio(d, "decode"),
    )
    add(
        "engine",
        "slice 2k prefill time over the ds4 engine's",
        "<= 1.0x",
        True,
        1.0,
        lambda d: engine_ratio(d, "prefill"),
    )
    return out


def render(found: list[Goal], results: dict[str, dict[str, Any]]) -> str:
    """The goals table, each step's machine load and time, and the decode profiles, as Markdown."""

    def verdict(goal: Goal) -> str:
        return "not measured" if goal.met is None else ("yes" if goal.met else "no")

    table = print_table(
        "Issue 19's goals, one run",
        ["goal", "target", "measured", "met", "detail", "file"],
        [[g.goal, g.target, g.measured, verdict(g), g.detail, g.source] for g in found],
    )
    lines = [
        table,
        "",
        "Steps (when each wrote its results, and the machine's 1-minute load average then):",
        "",
    ]
    for step in STEPS:
        data = results.get(step)
        machine = (data or {}).get("machine", {})
        lines.append(
            f"- {step}: "
            + (
                "not run"
                if data is None
                else f"{machine.get('time')}, load {machine.get('load_average_1m', 0):.2f}"
            )
        )
    profiles = results.get("decode_tiny", {}).get("profiles", {})
    for label, title in (
        ("bfloat16 torch", "the portable reference (before)"),
        ("bfloat16 vllm", "the fast path (after)"),
    ):
        if label in profiles:
            lines += [
                "",
                f"Top operators of batch-1 decode steps, tiny default, {title}:",
                "",
                "```",
                profiles[label],
                "```",
            ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--engine-src", type=Path, help="a checkout of antirez/ds4 (or a bare git directory of it)"
    )
    parser.add_argument(
        "--only", nargs="+", choices=[*STEPS, "tables"], help="run these steps only ('tables': none)"
    )
    parser.add_argument(
        "--results-dir", type=Path, default=RESULTS_DIR / f"{datetime.date.today().isoformat()}-goals"
    )
    args = parser.parse_args(argv)
    folder: Path = args.results_dir.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float] = {}
    for step in args.only or STEPS:
        if step == "tables":
            continue
        command = step_command(step, folder, args.engine_src)
        if command is None:
            print(f"{step}: skipped (no --engine-src)", flush=True)
            continue
        print(f"== {step}: {' '.join(command[1:])}", flush=True)
        started = time.perf_counter()
        subprocess.run(command, env=child_env(), check=True)
        wall[step] = time.perf_counter() - started
    summary = folder / "fast_model_goals.json"
    if summary.is_file():  # steps not rerun keep the wall times of the run that made their files
        wall = {**json.loads(summary.read_text()).get("step_wall_s", {}), **wall}
    results = {
        step: json.loads((folder / name).read_text())
        for step, name in FILES.items()
        if (folder / name).is_file()
    }
    found = goals(results)
    markdown = render(found, results)
    (folder / "fast_model_goals.md").write_text(markdown)
    write_json(
        str(summary),
        {"machine": machine_info(), "step_wall_s": wall, "goals": [dataclasses.asdict(g) for g in found]},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
