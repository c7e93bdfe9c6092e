"""Our model against the ds4 engine on the same real-width slice GGUF, one run (issue 19).

    .venv/bin/python -m benchmarks.engine_compare --engine-src /path/to/antirez-ds4 [--context 2048]

Builds the engine's CPU binaries from a checkout of ``antirez/ds4`` (or a bare git directory
of it) with ``../shared/tools/ds4-engine-build/build.sh`` into a scratch folder (its real
dimensions, 4 layers: the slice's), makes the slice (`slice_model.py`, 256 routed experts,
4.07 GB), then times, one after the other:

- the engine: ``ds4-bench --cpu -t 2`` over its own benchmark text, one prefill of
  ``--context`` tokens and ``--gen-tokens`` greedy decode steps (its CSV: ``prefill_tps``,
  ``gen_tps``), peak resident memory from ``getrusage(RUSAGE_CHILDREN)`` (the largest child
  process so far: the engine, larger than its compiler);
- ours: `model_scaling.engine_measurements` on the same file (vLLM's engine in this process,
  float32, eager body, the fused kernels for packed weights): time to first token of a
  ``--context``-token prompt and the batch-1 decode step at that context, peak resident memory
  (vLLM's KV pool ``--kv-cache-mib`` included: the benchmarks' default 2 GiB would be most of it).

Prints each goal with its ratio (ours / engine: prefill time, decode ms per token; our peak
memory / the file) and writes ``engine_compare.json`` into ``--results-dir``. The machine is
shared: run it when it is otherwise idle and read the ratios.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import resource
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.reporting import RESULTS_DIR, machine_info, print_table

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "tools" / "ds4-engine-build" / "build.sh"


def build_engine(source: Path, dest: Path, script: Path = BUILD_SCRIPT) -> Path:
    """The engine's ``ds4-bench`` built from ``source`` into ``dest`` with the slice's 4 layers."""
    if not script.is_file():
        raise SystemExit(f"{script}: the engine's build recipe is missing (give --build-script)")
    subprocess.run(["bash", str(script), str(source), str(dest), "4"], check=True)
    return dest / "ds4-bench"


def run_engine(bench: Path, model: Path, context: int, gen_tokens: int, threads: int) -> dict[str, Any]:
    """One ``ds4-bench`` frontier at ``context`` tokens: its CSV row and its peak memory."""
    with tempfile.TemporaryDirectory(prefix="ds4-engine-csv-") as tmp:
        csv_path = Path(tmp) / "result.csv"
        started = time.perf_counter()
        subprocess.run(
            [
                str(bench),
                "--cpu",
                "-t",
                str(threads),
                "-m",
                str(model),
                "--prompt-file",
                str(bench.parent / "speed-bench" / "promessi_sposi.txt"),
                "--ctx-start",
                str(context),
                "--ctx-max",
                str(context),
                "--gen-tokens",
                str(gen_tokens),
                "--warm-weights",
                "--csv",
                str(csv_path),
            ],
            check=True,
        )
        wall = time.perf_counter() - started
        row = next(csv.DictReader(csv_path.open()))
    return {
        "prefill_tokens_per_s": float(row["prefill_tps"]),
        "decode_tokens_per_s": float(row["gen_tps"]),
        "kvcache_bytes": int(row["kvcache_bytes"]),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "wall_s": wall,
    }


def run_ours(
    model: Path, config: Any, context: int, decode_tokens: int, kv_cache_bytes: int, max_num_seqs: int | None
) -> dict[str, Any]:
    from benchmarks.model_scaling import engine_measurements

    result = engine_measurements(
        str(model), config, [context], 1, context, decode_tokens, kv_cache_bytes, max_num_seqs
    )
    decode = result["decode_batch1"]
    return {
        "prefill_s": result["prefill"][str(context)]["ttft_s"],
        "decode_step_ms": decode["step_ms"],
        "peak_rss_bytes": result["peak_rss_bytes"],
        "measurements": result,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-src", type=Path, required=True, help="a checkout of antirez/ds4")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens, and the decode context")
    ap.add_argument("--gen-tokens", type=int, default=16, help="the engine's decode steps")
    ap.add_argument("--decode-tokens", type=int, default=9, help="our decode request's new tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--kv-cache-mib",
        type=int,
        default=160,
        help="vLLM's KV pool (part of our peak memory; vLLM asks for 0.14 GiB to hold one 2k-context "
        "request of the slice; the engine sizes its own to the context)",
    )
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="vLLM's batch limit (default vLLM's: 256 on a CPU; its start-up sampler run sizes buffers by it)",
    )
    ap.add_argument("--build-script", type=Path, default=BUILD_SCRIPT, help="the engine's build recipe")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR / datetime.date.today().isoformat())
    args = ap.parse_args()

    from benchmarks.slice_model import slice_for

    config, model, _ = slice_for("slice")
    with tempfile.TemporaryDirectory(prefix="ds4-engine-build-") as scratch:
        bench = build_engine(args.engine_src, Path(scratch) / "ds4", args.build_script)
        print(f"ds4 engine, {args.context} tokens:", flush=True)
        engine = run_engine(bench, model, args.context, args.gen_tokens, args.threads)
    print(f"ours, {args.context} tokens:", flush=True)
    ours = run_ours(
        model, config, args.context, args.decode_tokens, args.kv_cache_mib << 20, args.max_num_seqs
    )

    engine_prefill_s = args.context / engine["prefill_tokens_per_s"]
    engine_decode_ms = 1e3 / engine["decode_tokens_per_s"]
    file_bytes = model.stat().st_size
    rows = [
        [
            f"prefill {args.context} tokens (s)",
            ours["prefill_s"],
            engine_prefill_s,
            ours["prefill_s"] / engine_prefill_s,
            "<= 1.0",
        ],
        [
            f"batch-1 decode at {args.context} (ms/token)",
            ours["decode_step_ms"],
            engine_decode_ms,
            ours["decode_step_ms"] / engine_decode_ms,
            "<= 1.0",
        ],
        [
            "peak resident memory (GiB; ratio: to the file)",
            ours["peak_rss_bytes"] / 2**30,
            engine["peak_rss_bytes"] / 2**30,
            ours["peak_rss_bytes"] / file_bytes,
            "<= 1.3",
        ],
    ]
    table = print_table(
        f"Real-width slice ({file_bytes / 1e9:.2f} GB), {args.threads} threads each",
        ["measure", "ours", "ds4 engine", "ratio", "goal"],
        rows,
    )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / "engine_compare.json"
    path.write_text(
        json.dumps(
            {
                "machine": machine_info(),
                "settings": vars(args)
                | {"engine_src": str(args.engine_src), "results_dir": str(args.results_dir)},
                "file_bytes": file_bytes,
                "engine": engine,
                "ours": ours,
                "table_markdown": table,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
