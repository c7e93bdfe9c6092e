"""Run one fuzz target under atheris (libFuzzer) in this process; it exits when done.

    python -m tests.fuzz.run TARGET --runs N [--seed S] [--max-len B] [--work DIR] [--timeout S]

Inputs come from `tests/fuzz/corpus/TARGET/` (read only) and, when given, `--work DIR/corpus`
(where libFuzzer keeps the new inputs it finds); crash inputs are written to `--work DIR`
(default: a temporary directory) as `crash-<sha1>` and reported on stderr. libFuzzer's final
stats (`stat::number_of_executed_units`, `stat::average_exec_per_sec`) end the output; the exit
status is 0 when no input failed. Coverage is instrumented for `ds4_vllm` only.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import tempfile
from pathlib import Path

import atheris

CORPUS = Path(__file__).resolve().parent / "corpus"
# Memory one input may take beyond what the process started with before libFuzzer stops it.
RSS_HEADROOM_MB = 2048


def rss_limit_mb() -> int:
    """libFuzzer's `-rss_limit_mb` for this process: its starting peak plus the headroom.

    libFuzzer compares `getrusage().ru_maxrss` with the limit, and Linux carries that peak over a
    fork and exec from the parent: a fuzz run started by a pytest process holding 2.6 GB of vLLM
    engines starts at a 2.6 GB "peak" without allocating anything. Measure from that start.
    """
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return inherited_mb + RSS_HEADROOM_MB


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("--runs", type=int, default=10_000, help="inputs to execute (libFuzzer -runs)")
    parser.add_argument("--seed", type=int, default=1, help="libFuzzer random seed")
    parser.add_argument("--max-len", type=int, default=16384, help="largest input in bytes")
    parser.add_argument("--work", type=Path, default=None, help="folder for new corpus entries and crashes")
    parser.add_argument("--timeout", type=int, default=20, help="seconds one input may take")
    parser.add_argument(
        "--merge-into",
        type=Path,
        default=None,
        help="instead of fuzzing, copy into this folder the smallest set of inputs from --work/corpus and the "
        "seeds that keeps their coverage (libFuzzer -merge=1); used to grow tests/fuzz/corpus",
    )
    # libFuzzer re-runs this program with flags of its own for -merge=1 (argv0 below): pass them on.
    args, libfuzzer_own = parser.parse_known_args(argv)

    with atheris.instrument_imports(include=["ds4_vllm"]):
        from .targets import TARGETS
    if args.target not in TARGETS:
        parser.error(f"unknown target {args.target!r}; choose from {', '.join(TARGETS)}")
    work = args.work or Path(tempfile.mkdtemp(prefix=f"ds4-fuzz-{args.target}-"))
    new_inputs = work / "corpus"
    new_inputs.mkdir(parents=True, exist_ok=True)
    seeds = CORPUS / args.target
    argv0 = f"{sys.executable} -m tests.fuzz.run {args.target}"  # a command line, as libFuzzer re-runs it
    if libfuzzer_own:
        libfuzzer_args = [argv0, *libfuzzer_own]
    elif args.merge_into is not None:
        args.merge_into.mkdir(parents=True, exist_ok=True)
        libfuzzer_args = [
            argv0,
            "-merge=1",
            f"-max_len={args.max_len}",
            str(args.merge_into),
            str(new_inputs),
        ]
    else:
        libfuzzer_args = [
            argv0,
            f"-runs={args.runs}",
            f"-seed={args.seed}",
            f"-max_len={args.max_len}",
            f"-timeout={args.timeout}",
            f"-artifact_prefix={work}/",
            "-print_final_stats=1",
            f"-rss_limit_mb={rss_limit_mb()}",
            str(new_inputs),
            str(seeds),
        ]
        print(f"fuzz target={args.target} runs={args.runs} work={work}", file=sys.stderr, flush=True)
    # Quarantine and invalid-file warnings are expected by the thousand; keep them out of
    # libFuzzer's output (they would cost more time than the cases themselves). Set here, in the
    # fuzzing process only: in-process tests replaying the corpus must keep the logs they check.
    logging.getLogger("ds4_vllm").setLevel(logging.ERROR)
    atheris.Setup(libfuzzer_args, TARGETS[args.target])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
