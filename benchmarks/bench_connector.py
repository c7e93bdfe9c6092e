"""Speed of the `ds4disk` KV connector on the default `ds4` model (issue 4), in one run:

(a) time to first token of a cold prompt (process A, fresh engine, fresh temp kv_disk_dir)
    against the same prompt plus a short new suffix after a restart (process B, fresh engine,
    same directory, enable_prefix_caching=False so the prefix can only come from disk);
(b) restore read bandwidth: `ds4_vllm.kvc.open_checkpoint` + copying every payload array into
    a preallocated buffer, against a plain sequential read of the same files (8 MiB chunks);
    both with a warm page cache (nothing is dropped). The timings are `file_reads`', the same
    as `micro` (a) takes with the page cache dropped;
(c) decode tokens/s of one request with and without the connector (same engine otherwise).

    .venv/bin/python -m benchmarks.bench_connector                        # 2k and 8k tokens
    .venv/bin/python -m benchmarks.bench_connector --lengths 2048 8192 32768

Phases A, B and (c) run as subprocesses of this script (`--phase cold|restored|decode`),
so "after restart" is a real new process. Writes benchmarks/results/connector.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.file_reads import checkpoint_restore, sequential_read
from benchmarks.reporting import (
    child_env,
    ds4disk_config,
    machine_info,
    make_engine,
    module_command,
    print_table,
    random_prompts,
    shutdown_engine,
    timed_generate,
    write_json,
)

CHUNK = 8 << 20
FLUSH_PROMPT = 64  # below kv_cache_min_tokens (512): neither saved nor looked up


# ---------------------------------------------------------------------------- engine phases


def prompt_for(length: int, run: int) -> list[int]:
    # Distinct per length and run: no two prompts share a prefix.
    return random_prompts([length], seed=1000 + length + 7919 * run)[0]


def suffix_for(length: int, run: int, n: int) -> list[int]:
    return random_prompts([n], seed=5000 + length + 7919 * run)[0]


def wait_quiet(directory: Path | None, timeout: float = 60.0) -> None:
    """Wait until the connector's background writer has finished (no temp files, sizes stable)."""
    if directory is None:
        return
    deadline = time.monotonic() + timeout
    last: dict[str, int] | None = None
    while time.monotonic() < deadline:
        entries = {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}
        busy = any(".tmp." in name for name in entries)
        if not busy and entries == last:
            return
        last = entries
        time.sleep(0.5)


def flush(llm: Any, directory: Path | None) -> None:
    """One short untimed step, so a finished request's `evict` save (made at the next step)
    happens now and not inside the next timed request; then wait for the disk writer."""
    timed_generate(llm, random_prompts([FLUSH_PROMPT], seed=int(time.time_ns() % 100000)), 1)
    wait_quiet(directory)


def connector_engine(args: argparse.Namespace, directory: Path | None) -> Any:
    extra: dict[str, Any] = {}
    if directory is not None:
        extra["kv_transfer_config"] = ds4disk_config(directory)
    return make_engine(
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        **extra,
    )


def phase_ttft(args: argparse.Namespace, restored: bool) -> dict[str, Any]:
    """Process A (cold) or B (restored): TTFT per length, best of --repeats distinct prompts."""
    directory = Path(args.dir)
    llm = connector_engine(args, directory)
    flush(llm, directory)  # warm-up
    out: dict[str, Any] = {}
    for n in args.lengths:
        runs = []
        for r in range(args.repeats):
            prompt = prompt_for(n, r) + (suffix_for(n, r, args.suffix) if restored else [])
            seconds, outs = timed_generate(llm, [prompt], 1)
            cached = outs[0].num_cached_tokens
            kind = "restored" if restored else "cold"
            print(f"[phase] {kind} {len(prompt)} tokens: ttft {seconds:.3f} s, cached {cached}", flush=True)
            runs.append({"prompt_tokens": len(prompt), "ttft_s": seconds, "num_cached_tokens": cached})
            flush(llm, directory)
        out[str(n)] = min(runs, key=lambda x: x["ttft_s"]) | {"all_ttft_s": [x["ttft_s"] for x in runs]}
    shutdown_engine(llm)
    wait_quiet(directory)
    return out


def phase_decode(args: argparse.Namespace) -> dict[str, Any]:
    directory = Path(args.dir) if args.dir else None
    llm = connector_engine(args, directory)
    flush(llm, directory)  # warm-up
    n, new = args.decode_prompt, args.decode_tokens
    firsts, totals = [], []
    for r in range(args.repeats):
        # Distinct prompts of one length: every run is a cold prefill of the same cost.
        firsts.append(timed_generate(llm, random_prompts([n], seed=300 + r), 1)[0])
        flush(llm, directory)
        totals.append(timed_generate(llm, random_prompts([n], seed=400 + r), new)[0])
        flush(llm, directory)
    shutdown_engine(llm)
    decode_s = max(min(totals) - min(firsts), 1e-9)
    return {
        "connector": directory is not None,
        "prompt_tokens": n,
        "new_tokens": new,
        "first_token_s": min(firsts),
        "total_s": min(totals),
        "step_ms": 1000 * decode_s / (new - 1),
        "tokens_per_s": (new - 1) / decode_s,
    }


# ---------------------------------------------------------------------------- read bandwidth


def read_bandwidth(paths: list[Path], repeats: int) -> list[dict[str, Any]]:
    """One row per (tokens, reason) among `paths`, smallest file first."""
    from ds4_vllm.kvc import read_prefix

    rows: list[dict[str, Any]] = []
    seen: set[tuple[int, str]] = set()
    for path in sorted(paths, key=lambda p: p.stat().st_size):
        header = read_prefix(path, with_text=False).header
        if (header.tokens, header.reason_name) in seen:
            continue
        seen.add((header.tokens, header.reason_name))
        size = path.stat().st_size
        buf = bytearray(CHUNK)
        dst = np.empty(size // 4 + 1, dtype=np.float32)
        sequential_read(path, buf), checkpoint_restore(path, dst)  # warm the page cache and the code
        seq = min(sequential_read(path, buf) for _ in range(repeats))
        res = min(checkpoint_restore(path, dst) for _ in range(repeats))
        rows.append(
            {
                "file": path.name,
                "tokens": header.tokens,
                "reason": header.reason_name,
                "mib": size / 2**20,
                "sequential_read_mib_s": size / 2**20 / seq,
                "restore_read_mib_s": size / 2**20 / res,
                "restore_over_sequential": seq / res,
            }
        )
    return rows


# ---------------------------------------------------------------------------- orchestration


def run_phase(args: argparse.Namespace, phase: str, directory: Path | None, log: Path) -> dict[str, Any]:
    """Run one engine phase as a fresh Python process; return its JSON result."""
    result_file = log.with_suffix(".json")
    cmd = [
        *module_command("benchmarks.bench_connector"),
        "--phase",
        phase,
        "--result-file",
        str(result_file),
        "--lengths",
        *map(str, args.lengths),
        "--suffix",
        str(args.suffix),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--decode-prompt",
        str(args.decode_prompt),
        "--decode-tokens",
        str(args.decode_tokens),
        "--repeats",
        str(args.repeats),
    ]
    if directory is not None:
        cmd += ["--dir", str(directory)]
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as fp:
        proc = subprocess.run(
            cmd, stdout=fp, stderr=subprocess.STDOUT, timeout=args.phase_timeout, env=child_env()
        )
    text = log.read_text()
    for line in text.splitlines():
        if line.startswith("[phase]") or re.search(r"kv cache (hit|loaded|stored|skipped|load failed)", line):
            print("   ", line[line.find("kv cache") if "kv cache" in line else 0 :][:160])
    if proc.returncode != 0:
        raise SystemExit(f"phase {phase} failed (rc {proc.returncode}); log {log}:\n{text[-4000:]}")
    result = json.loads(result_file.read_text())
    result["process_s"] = time.perf_counter() - t0
    result["load_ms_logged"] = [
        float(m) for m in re.findall(r"kv cache loaded tokens=\d+ .* load=([\d.]+) ms", text)
    ]
    return result


def orchestrate(args: argparse.Namespace) -> None:
    info = machine_info()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ds4-bench-") as tmp:
        work = Path(tmp)
        kv_dir, decode_dir = work / "kv", work / "kv-decode"
        kv_dir.mkdir()
        decode_dir.mkdir()

        print("(a) process A: cold prompts", flush=True)
        cold = run_phase(args, "cold", kv_dir, work / "cold.log")
        cold_files = sorted(kv_dir.glob("*.kv"))
        files = [(p.name, p.stat().st_size) for p in cold_files]
        print("(a) process B: same prompts + suffix after a restart", flush=True)
        restored = run_phase(args, "restored", kv_dir, work / "restored.log")

        print("(b) read bandwidth", flush=True)
        reads = read_bandwidth(cold_files, args.repeats + 1) if not args.skip_read else []

        decode: dict[str, Any] = {}
        if not args.skip_decode:
            print("(c) decode without / with the connector", flush=True)
            decode["without"] = run_phase(args, "decode", None, work / "decode-off.log")
            decode["with"] = run_phase(args, "decode", decode_dir, work / "decode-on.log")

    ttft_rows = []
    ttft: dict[str, Any] = {}
    for n in args.lengths:
        c, r = cold[str(n)], restored[str(n)]
        ttft[str(n)] = {"cold": c, "restored": r, "speedup": c["ttft_s"] / r["ttft_s"]}
        ttft_rows.append(
            [n, c["ttft_s"], r["prompt_tokens"], r["ttft_s"], r["num_cached_tokens"], ttft[str(n)]["speedup"]]
        )
    tables = [
        print_table(
            "(a) TTFT cold vs restored after restart",
            [
                "prompt tokens",
                "cold TTFT s",
                "B prompt tokens",
                "restored TTFT s",
                "num_cached_tokens",
                "speed-up",
            ],
            ttft_rows,
        )
    ]
    if reads:
        tables.append(
            print_table(
                "(b) restore read vs sequential read (warm page cache)",
                [
                    "file tokens",
                    "reason",
                    "MiB",
                    "sequential MiB/s",
                    "open_checkpoint+copy MiB/s",
                    "restore / sequential",
                ],
                [
                    [
                        r["tokens"],
                        r["reason"],
                        r["mib"],
                        r["sequential_read_mib_s"],
                        r["restore_read_mib_s"],
                        r["restore_over_sequential"],
                    ]
                    for r in reads
                ],
            )
        )
    if decode:
        off, on = decode["without"], decode["with"]
        decode["ratio_with_over_without"] = on["tokens_per_s"] / off["tokens_per_s"]
        tables.append(
            print_table(
                f"(c) decode, 1 request, prompt {args.decode_prompt}, {args.decode_tokens} new tokens",
                ["connector", "ms/step", "tokens/s", "with / without"],
                [
                    ["without", off["step_ms"], off["tokens_per_s"], 1.0],
                    ["with ds4disk", on["step_ms"], on["tokens_per_s"], decode["ratio_with_over_without"]],
                ],
            )
        )
    write_json(
        args.output,
        {
            "benchmark": "bench_connector",
            "machine": info,
            "settings": {
                "lengths": args.lengths,
                "suffix_tokens": args.suffix,
                "max_model_len": args.max_model_len,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "enable_prefix_caching": False,
                "decode_prompt_tokens": args.decode_prompt,
                "decode_new_tokens": args.decode_tokens,
                "repeats": args.repeats,
                "page_cache": "warm (nothing dropped)",
            },
            "files_after_cold": [{"file": n, "bytes": s} for n, s in files],
            "ttft": ttft,
            "read_bandwidth": reads,
            "decode": decode,
            "table_markdown": "\n\n".join(tables),
            "wall_s": time.perf_counter() - t_start,
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192], help="prompt lengths for (a)")
    ap.add_argument("--suffix", type=int, default=16, help="new tokens appended in process B")
    ap.add_argument("--max-model-len", type=int, default=40000)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--decode-prompt", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="best of N: distinct prompts per length in (a), runs in (c); N+1 reads in (b)",
    )
    ap.add_argument("--skip-read", action="store_true", help="skip (b)")
    ap.add_argument("--skip-decode", action="store_true", help="skip (c)")
    ap.add_argument("--phase-timeout", type=float, default=1800, help="seconds per engine process")
    ap.add_argument("--output", default="connector.json", help="file name under benchmarks/results/")
    # internal: one engine phase in this process
    ap.add_argument("--phase", choices=["cold", "restored", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.phase is None:
        orchestrate(args)
        return
    if args.phase == "decode":
        result = phase_decode(args)
    else:
        result = phase_ttft(args, restored=args.phase == "restored")
    Path(args.result_file).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
