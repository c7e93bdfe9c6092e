"""vLLM's compiled model body against ``enforce_eager``, and what compiling costs at start (issue 19).

    .venv/bin/python -m benchmarks.compiled_decode                  # bf16, batch 1 and 8
    .venv/bin/python -m benchmarks.compiled_decode --dtype float32 --steps 32 --repeats 2

Each engine runs in its own process (the tiny default, vLLM's CPU runner, prefix caching off),
in this order: eager, compiled with empty compile caches (a cold start: Dynamo's trace and
Inductor's C++ build), compiled again on those caches (a warm start), eager again. Each reports
its start time (`LLM(...)` until it answers) and its decode step at batch 1 and 8 with every
request at ``--context`` tokens: once every request of the batch has its first token, the
engine's steps (its core in the process: one `LLMEngine.step` is one scheduler step) are timed
in ``--repeats`` windows of ``--steps`` steps each; the median window is reported. The two
eager engines bracket any drift in the machine's load. Both modes must answer with the same tokens; the run says whether they did.

Writes ``compiled_decode.json`` into ``--results-dir`` (default
``benchmarks/results/<YYYY-MM-DD>/``). Read the ratios; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.reporting import RESULTS_DIR, child_env, machine_info, module_command, print_table

BATCHES = (1, 8)


def measure(dtype: str, eager: bool, context: int, steps: int, repeats: int) -> dict[str, Any]:
    """In this process: start one engine, time its decode steps; what `main` reads from stdout.

    The engine core runs in this process (`model_scaling.in_process_engine_core`), so that each
    ``LLMEngine.step`` is one scheduler step and the decode steps are timed one by one once every
    request of the batch has its first token; subtracting a 1-token run from a longer one would
    leave the decode time under the noise of the batch's prefills (eight 2k prefills take ~16 s,
    32 decode steps ~1 s).
    """
    from benchmarks.model_scaling import in_process_engine_core
    from benchmarks.reporting import greedy, make_engine, random_prompts, shutdown_engine

    start = time.perf_counter()
    with in_process_engine_core():
        llm = make_engine(dtype=dtype, enforce_eager=eager, enable_prefix_caching=False, max_num_seqs=8)
    result: dict[str, Any] = {"start_s": time.perf_counter() - start, "decode_ms": {}, "tokens": []}
    engine = llm.llm_engine

    def decode_windows(batch: int, seed: int) -> tuple[list[float], list[list[int]]]:
        """``repeats`` windows of ``steps`` decode steps of one batch: ms per step each, and its tokens."""
        prompts = random_prompts([context] * batch, seed=seed)
        ids = [f"{seed}-{i}" for i in range(batch)]
        # Enough tokens that none finishes inside the timed windows: the first request to finish
        # its prefill decodes alongside the others' prefill chunks (up to ``batch`` steps early).
        max_tokens = batch + repeats * steps + 1
        for req_id, prompt in zip(ids, prompts, strict=True):
            engine.add_request(req_id, {"prompt_token_ids": prompt}, greedy(max_tokens))
        started: set[str] = set()
        tokens: dict[str, list[int]] = {}

        def step() -> None:
            for out in engine.step():
                started.add(out.request_id)
                tokens[out.request_id] = list(out.outputs[0].token_ids)

        while len(started) < batch:  # prefills (chunked), until every request has its first token
            step()
        windows = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            windows.append((time.perf_counter() - t0) / steps * 1e3)
        while engine.has_unfinished_requests():
            step()
        return windows, [tokens[i] for i in ids]

    try:
        decode_windows(1, 1)  # warm-up
        for batch in BATCHES:
            # the same prompts in every engine
            result["decode_ms"][str(batch)], tokens = decode_windows(batch, 1000 * batch)
            if len(tokens) > len(result["tokens"]):
                result["tokens"] = tokens
    finally:
        shutdown_engine(llm)
    return result


def run_child(dtype: str, eager: bool, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    command = module_command(
        "benchmarks.compiled_decode",
        "--child",
        "eager" if eager else "compiled",
        "--dtype",
        dtype,
        "--context",
        str(args.context),
        "--steps",
        str(args.steps),
        "--repeats",
        str(args.repeats),
    )
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"engine run failed ({done.returncode}):\n{done.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR / datetime.date.today().isoformat())
    parser.add_argument("--child", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = measure(args.dtype, args.child == "eager", args.context, args.steps, args.repeats)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ds4-compile-cache-") as caches:
        compiled_env = child_env()
        compiled_env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
        compiled_env["VLLM_CACHE_ROOT"] = os.path.join(caches, "vllm")
        for name, eager, env in [
            ("eager", True, child_env()),
            ("compiled, cold caches", False, compiled_env),
            ("compiled, warm caches", False, compiled_env),
            ("eager again", True, child_env()),
        ]:
            print(f"{name}...", flush=True)
            runs[name] = run_child(args.dtype, eager, args, env)
    eager_ms = {
        b: statistics.median(runs["eager"]["decode_ms"][b] + runs["eager again"]["decode_ms"][b])
        for b in map(str, BATCHES)
    }
    eager_start = statistics.median([runs["eager"]["start_s"], runs["eager again"]["start_s"]])
    rows = []
    for name, run in runs.items():
        row: list[Any] = [name, run["start_s"], run["start_s"] - eager_start]
        for b in map(str, BATCHES):
            ms = statistics.median(run["decode_ms"][b])
            row += [ms, eager_ms[b] / ms]
        rows.append(row)
    same_tokens = len({json.dumps(run["tokens"]) for run in runs.values()}) == 1
    header = ["engine", "start s", "start - eager s"]
    for b in BATCHES:
        header += [f"batch {b} ms/step", f"batch {b} eager/this"]
    table = print_table(f"compiled vs eager, {args.dtype}, context {args.context}", header, rows)
    print(f"same tokens in every engine: {same_tokens}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / "compiled_decode.json"
    path.write_text(
        json.dumps(
            {
                "machine": machine_info(),
                "args": {k: str(v) for k, v in vars(args).items()},
                "runs": runs,
                "same_tokens": same_tokens,
                "table": table,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
