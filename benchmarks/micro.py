"""Microbenchmarks of the KV checkpoint path (issue 11), ratios measured side by side in one run.

(a) Checkpoint save and restore throughput through the kvc layer (`ds4_vllm.kvc`, what the
    store's writer and the connector's loader call): `write_checkpoint` (streamed, fsync'ed) of
    a payload with the model's real section shapes, and `open_checkpoint` + copying every payload
    array into a preallocated buffer, against a plain sequential write (8 MiB chunks + fsync) and
    read (`readinto`, 8 MiB chunks) of the same number of bytes, in the same directory. Before
    every read the file's pages are dropped from the page cache with
    `posix_fadvise(POSIX_FADV_DONTNEED)` after an fsync (no privileges needed), and `mincore`
    confirms none is resident. Default model and real-width slice model (`slice_model.py`),
    2k/8k/32k/128k tokens (quick: 2k, 8k). Median of 3.
(b) Cost of the lookup the connector's scheduler makes per request
    (`CheckpointStore.lookup(text, tokens, ctx, quant)`: directory check, index scan, prefix
    hashing, token agreement of the hit) with 10, 1,000 and 10,000 real checkpoint files in the
    directory. Median over many calls.
(c) Restart restore through the real connector: engine A prefills a prompt cold (the connector
    saves it), then a new engine B (new process, same directory, page cache of the files dropped)
    gets the prompt plus a 16-token suffix. Compared with A's cold prefill and with a sequential
    read of the restored file (cache dropped) plus B's prefill of a fresh 16-token prompt.
    Full run: the slice model at 32k tokens; quick run: the default model at 2k.

    python -m benchmarks.micro            # full (the 32k cold prefill of the slice takes long)
    python -m benchmarks.micro --quick    # a few minutes

Writes benchmarks/results/<YYYY-MM-DD>/micro.json and micro.png. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.file_reads import checkpoint_restore, sequential_read
from benchmarks.micro_render import plot, tables
from benchmarks.micro_results import (
    EnginePhase,
    LookupRow,
    MicroResults,
    RestartResult,
    ThroughputRow,
)
from benchmarks.page_cache import drop_file_cache, page_cache_control
from benchmarks.reporting import RESULTS_DIR, child_env, machine_info, module_command
from ds4_vllm.kvc import (
    KvcHeader,
    ModelDims,
    PayloadData,
    SaveReason,
    open_checkpoint,
    write_checkpoint,
)
from ds4_vllm.kvc.index import DIR_SETTLE_NS
from ds4_vllm.kvc.synthetic import random_payload

CHUNK = 8 << 20
FULL_LENGTHS = (2048, 8192, 32768, 131072)
QUICK_LENGTHS = (2048, 8192)
LOOKUP_COUNTS = (10, 1000, 10000)
REPEATS = 3
SUFFIX_TOKENS = 16
TEXT_BYTES_PER_TOKEN = 4  # about what DeepSeek's tokenizer gives on English text


# ---------------------------------------------------------------------------- (a) throughput


def dims_of(config: Any) -> ModelDims:
    """The KVC payload dims the connector records for a model config (`Ds4KVLayout.dims`)."""
    return ModelDims(config.num_hidden_layers, config.head_dim, config.index_head_dim, config.vocab_size)


def synthetic_payload(
    dims: ModelDims, n_tokens: int, ctx_size: int, seed: int, tokens: Sequence[int] | None = None
) -> PayloadData:
    """A payload with the sections the connector writes for `n_tokens` (random float32 values)."""
    rng = np.random.default_rng(seed)
    return random_payload(dims, rng, tokens=n_tokens if tokens is None else tokens, ctx_size=ctx_size)


def sequential_write(path: Path, nbytes: int, block: bytes) -> float:
    """Seconds to write `nbytes` (chunks of `block`) and fsync, like a writer without structure."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        view = memoryview(block)
        while left:
            n = os.write(fd, view[: min(left, len(block))])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def checkpoint_throughput(
    model: str, dims: ModelDims, lengths: Sequence[int], work: Path, repeats: int = REPEATS
) -> list[ThroughputRow]:
    """(a) for one model: one row per length, medians of `repeats` save/restore/write/read runs."""
    rows = []
    block = secrets.token_bytes(CHUNK)
    buf = bytearray(CHUNK)
    for n in lengths:
        directory = work / f"{model}-{n}"
        directory.mkdir(parents=True, exist_ok=True)
        payload = synthetic_payload(dims, n, ctx_size=max(n + 4096, 8192), seed=n)
        text = secrets.token_bytes(n * TEXT_BYTES_PER_TOKEN)
        header = KvcHeader.new(quant_bits=2, reason=SaveReason.EVICT, tokens=n, ctx_size=max(n + 4096, 8192))
        saves, restores, writes, reads, resident = [], [], [], [], []
        dst: np.ndarray | None = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            path = write_checkpoint(directory, text, header, payload, fsync=True)
            saves.append(time.perf_counter() - t0)
            size = path.stat().st_size
            if dst is None:
                dst = np.empty(size // 4 + 1, dtype=np.float32)
            plain = directory / "plain.bin"
            writes.append(sequential_write(plain, size, block))
            resident.append(max(drop_file_cache(path), drop_file_cache(plain)))
            reads.append(sequential_read(plain, buf))
            restores.append(checkpoint_restore(path, dst))
            path.unlink()
            plain.unlink()
        row = ThroughputRow(
            model=model,
            tokens=n,
            file_mib=size / 2**20,
            save_s=statistics.median(saves),
            sequential_write_s=statistics.median(writes),
            restore_s=statistics.median(restores),
            sequential_read_s=statistics.median(reads),
            resident_after_drop=max(resident),
            all_save_s=saves,
            all_write_s=writes,
            all_restore_s=restores,
            all_read_s=reads,
        )
        print(
            f"(a) {model} {n} tokens {row.file_mib:.1f} MiB: save {row.save_s:.3f} s "
            f"(write {row.sequential_write_s:.3f}), restore {row.restore_s:.3f} s "
            f"(read {row.sequential_read_s:.3f})",
            flush=True,
        )
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- (b) lookup

LOOKUP_DIMS = ModelDims(n_layer=5, head_dim=8, index_dim=4, n_vocab=64)  # small files, real format


def populate_store(directory: Path, count: int, prompt_tokens: int, seed: int) -> tuple[bytes, list[int]]:
    """`count` checkpoint files of distinct texts; one is a 2/3 prefix of the returned prompt.

    Texts are random bytes of 512..`prompt_tokens` tokens (4 bytes each), as left by many sessions;
    the returned prompt (text and tokens) extends the hit file's text by a new suffix.
    """
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    prompt = rng.integers(1000, 60000, prompt_tokens).tolist()
    prompt_text = b"".join(t.to_bytes(4, "little") for t in prompt)
    hit = (2 * prompt_tokens // 3) // 64 * 64
    for i in range(count):
        if i == 0:
            tokens = prompt[:hit]
        else:
            tokens = rng.integers(1000, 60000, int(rng.integers(512, prompt_tokens + 1))).tolist()
        text = b"".join(t.to_bytes(4, "little") for t in tokens)
        header = KvcHeader.new(quant_bits=2, reason=SaveReason.CONTINUED, tokens=len(tokens), ctx_size=65536)
        payload = synthetic_payload(LOOKUP_DIMS, len(tokens), 65536, seed=i, tokens=tokens)
        write_checkpoint(directory, text, header, payload, fsync=False)
    return prompt_text, prompt


def lookup_cost(
    counts: Sequence[int], work: Path, calls: int = 200, prompt_tokens: int = 4096
) -> list[LookupRow]:
    """(b): median seconds of `CheckpointStore.lookup` with `count` files in the directory."""
    from ds4_vllm.store.checkpoint_store import CheckpointStore
    from ds4_vllm.store.options import StoreOptions

    rows = []
    for count in counts:
        directory = work / f"lookup-{count}"
        t0 = time.perf_counter()
        prompt_text, prompt = populate_store(directory, count, prompt_tokens, seed=count)
        made_s = time.perf_counter() - t0
        options = StoreOptions(disk_dir=str(directory), disk_space_mb=1 << 20).validate()
        store = CheckpointStore(options, model_dims=LOOKUP_DIMS, fsync=False).open()
        t0 = time.perf_counter()
        first = store.lookup(prompt_text, prompt, 65536, 2)  # reads the directory
        first_s = time.perf_counter() - t0
        times, cpu_times = [], []
        for _ in range(calls):
            t0, c0 = time.perf_counter(), time.thread_time()
            outcome = store.lookup(prompt_text, prompt, 65536, 2)
            cpu_times.append(time.thread_time() - c0)
            times.append(time.perf_counter() - t0)
        if not (first.hit and outcome.hit):
            raise RuntimeError(f"lookup with {count} files missed: {outcome}")
        # Every refresh interval (2 s) a lookup also rechecks the directory. A store whose interval
        # is 0 pays that on every lookup: with the directory unchanged (and older than the index's
        # settle time), and right after a change (here: the directory's mtime moved), which lists
        # the directory but stats only new or renamed-over files.
        rescanning = CheckpointStore(
            options, model_dims=LOOKUP_DIMS, fsync=False, refresh_interval_s=0
        ).open()  # opening probes the directory (a write): wait until that change has settled
        time.sleep(DIR_SETTLE_NS / 1e9)
        rescanning.lookup(prompt_text, prompt, 65536, 2)
        unchanged, changed = [], []
        for i in range(2 * calls):
            if i >= calls:  # a change makes the directory young: it is listed at every check
                os.utime(directory)
            t0 = time.perf_counter()
            hit = rescanning.lookup(prompt_text, prompt, 65536, 2).hit
            (changed if i >= calls else unchanged).append(time.perf_counter() - t0)
            if not hit:
                raise RuntimeError(f"lookup with {count} files and a rescan missed")
        rescans = []
        for _ in range(REPEATS):  # a forced full rescan (eviction, `entries()`): stats every file
            t0 = time.perf_counter()
            store.entries()
            rescans.append(time.perf_counter() - t0)
        row = LookupRow(
            entries=count,
            median_ms=1000 * statistics.median(times),
            p90_ms=1000 * float(np.percentile(times, 90)),
            p99_ms=1000 * float(np.percentile(times, 99)),
            p99_cpu_ms=1000 * float(np.percentile(cpu_times, 99)),
            first_lookup_ms=1000 * first_s,
            lookup_unchanged_rescan_ms=1000 * statistics.median(unchanged),
            lookup_after_change_ms=1000 * statistics.median(changed),
            rescan_ms=1000 * statistics.median(rescans),
            hit_tokens=outcome.agreed_tokens,
            prompt_tokens=prompt_tokens,
            calls=calls,
            populate_s=made_s,
        )
        print(
            f"(b) {count} entries: lookup median {row.median_ms:.3f} ms, p90 {row.p90_ms:.3f} ms, "
            f"p99 {row.p99_ms:.3f} ms (CPU {row.p99_cpu_ms:.3f} ms), first after open "
            f"{row.first_lookup_ms:.1f} ms; with the periodic rescan: unchanged dir "
            f"{row.lookup_unchanged_rescan_ms:.3f} ms, after a change {row.lookup_after_change_ms:.2f} ms; "
            f"forced full rescan {row.rescan_ms:.1f} ms",
            flush=True,
        )
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- (c) restart restore


def _engine(model: str, directory: Path, max_model_len: int) -> Any:
    from benchmarks.reporting import ds4disk_config, make_engine

    return make_engine(
        model=model,
        max_model_len=max_model_len,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        kv_transfer_config=ds4disk_config(directory),
    )


def phase(args: argparse.Namespace) -> dict[str, Any]:
    """One engine process of (c): `cold` (prefill the prompt) or `restored` (prompt + suffix)."""
    from benchmarks.bench_connector import flush, prompt_for, suffix_for, wait_quiet
    from benchmarks.reporting import shutdown_engine, timed_generate

    directory = Path(args.dir)
    t0 = time.perf_counter()
    llm = _engine(args.model, directory, args.max_model_len)
    out: dict[str, Any] = {"engine_start_s": time.perf_counter() - t0}
    flush(llm, directory)  # warm-up, below the connector's minimum length
    n = args.length
    if args.phase == "cold":
        seconds, outs = timed_generate(llm, [prompt_for(n, 0)], 1)
        out |= {"prompt_tokens": n, "ttft_s": seconds}
        print(f"[phase] cold {n} tokens: ttft {seconds:.3f} s", flush=True)
        flush(llm, directory)  # the finished request's evict save happens at the next step
    else:
        suffix_only = []
        for r in range(REPEATS):  # prefill of a fresh suffix-length prompt (nothing to restore)
            suffix_only.append(timed_generate(llm, [suffix_for(n, 100 + r, SUFFIX_TOKENS)], 1)[0])
        prompt = prompt_for(n, 0) + suffix_for(n, 0, SUFFIX_TOKENS)
        seconds, outs = timed_generate(llm, [prompt], 1)
        out |= {
            "prompt_tokens": len(prompt),
            "ttft_s": seconds,
            "num_cached_tokens": outs[0].num_cached_tokens,
            "suffix_prefill_s": statistics.median(suffix_only),
            "suffix_prefill_all_s": suffix_only,
        }
        print(
            f"[phase] restored {len(prompt)} tokens: ttft {seconds:.3f} s, cached {outs[0].num_cached_tokens}"
        )
    shutdown_engine(llm)
    wait_quiet(directory)
    return out


def _run_phase(args: argparse.Namespace, name: str, model: str, directory: Path, log: Path) -> EnginePhase:
    result = log.with_suffix(".json")
    cmd = [
        *module_command("benchmarks.micro"),
        "--phase",
        name,
        "--model",
        model,
        "--dir",
        str(directory),
        "--length",
        str(args.restart_length),
        "--max-model-len",
        str(args.restart_length + 4096),
        "--result-file",
        str(result),
    ]
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    # One forward of a 2,048-token chunk of the slice takes minutes on a loaded 2-core machine;
    # vLLM's default 300 s limit per execute_model call would kill the engine.
    env = child_env({**os.environ, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(int(args.phase_timeout))})
    with open(log, "w") as fp:
        proc = subprocess.run(cmd, stdout=fp, stderr=subprocess.STDOUT, timeout=args.phase_timeout, env=env)
    text = log.read_text()
    for line in text.splitlines():
        if line.startswith("[phase]") or re.search(r"kv cache (hit|loaded|stored)", line):
            print("   ", line[line.find("kv cache") if "kv cache" in line else 0 :][:160], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"phase {name} failed (rc {proc.returncode}); log {log}:\n{text[-3000:]}")
    loads = [float(m) for m in re.findall(r"kv cache loaded tokens=\d+ .* load=([\d.]+) ms", text)]
    return EnginePhase(**json.loads(result.read_text()), load_ms_logged=loads)


def restart_restore(args: argparse.Namespace, model: str, label: str, work: Path) -> RestartResult:
    """(c): cold prefill in engine A, restore after a restart in engine B, both through ds4disk."""
    directory = work / "restart-kv"
    directory.mkdir(parents=True, exist_ok=True)
    cold = _run_phase(args, "cold", model, directory, work / "restart-cold.log")
    files = sorted(directory.glob("*.kv"), key=lambda p: p.stat().st_size)
    resident = max((drop_file_cache(p) for p in files), default=0.0)
    restored = _run_phase(args, "restored", model, directory, work / "restart-restored.log")
    # The file B restored: the longest one (the evict checkpoint of the whole prompt).
    biggest = files[-1]
    with open_checkpoint(biggest) as ck:
        payload_dims = ck.payload.header.as_dict()
    drop_file_cache(biggest)
    buf = bytearray(CHUNK)
    reads = []
    for _ in range(REPEATS):
        drop_file_cache(biggest)
        reads.append(sequential_read(biggest, buf))
    out = RestartResult(
        model=label,
        prompt_tokens=args.restart_length,
        suffix_tokens=SUFFIX_TOKENS,
        cold=cold,
        restored=restored,
        files=[{"file": p.name, "bytes": p.stat().st_size} for p in files],
        restored_file_payload_header=payload_dims,
        resident_before_restore=resident,
        sequential_read_s=statistics.median(reads),
    )
    print(
        f"(c) {label} {args.restart_length}: cold {cold.ttft_s:.2f} s, restored {restored.ttft_s:.3f} s "
        f"({out.speedup_vs_cold:.1f}x), read {out.sequential_read_s:.4f} s + suffix "
        f"{restored.suffix_prefill_s:.3f} s -> restored / (read + suffix) = "
        f"{out.restored_over_read_plus_suffix:.2f}",
        flush=True,
    )
    return out


def _slice_config() -> Any:
    from benchmarks.slice_model import slice_config

    return slice_config()


PARTS = ("throughput", "lookup", "restart")


def run(
    results_dir: Path,
    quick: bool,
    *,
    parts: Sequence[str] = PARTS,
    lookup_counts: Sequence[int] = LOOKUP_COUNTS,
    restart_model: str | None = None,
    restart_length: int | None = None,
    name: str = "micro",
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the `parts` of (a) throughput, (b) lookup, (c) restart; write <name>.json and .png.

    quick: (a) at 2k and 8k, (c) on the default model at 2k; full: (a) at 2k-128k, (c) on the
    slice model at 32k. `restart_model` ("ds4", "slice", "slice:N" for N routed experts, or a model
    path) and `restart_length` override (c).
    Returns the JSON's content (`MicroResults.to_json`, with the part's `table_markdown` and `plots`).
    """
    from ds4_vllm.model.default_model import default_config

    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; known: {PARTS}")
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    restart_model = restart_model or ("ds4" if quick else "slice")
    args = argparse.Namespace(
        restart_length=restart_length or (2048 if quick else 32768),
        phase_timeout=600 if quick else 4 * 3600,
    )
    started = time.perf_counter()
    results = MicroResults(quick=quick, machine=machine_info(), page_cache=page_cache_control())
    lengths = QUICK_LENGTHS if quick else FULL_LENGTHS
    with tempfile.TemporaryDirectory(prefix="ds4-micro-", dir=os.environ.get("DS4_BENCH_TMP")) as tmp:
        work = Path(tmp)
        if "throughput" in parts:
            progress("(a) checkpoint save/restore throughput")
            results.throughput = {
                "ds4": checkpoint_throughput("ds4", dims_of(default_config()), lengths, work),
                "slice": checkpoint_throughput("slice", dims_of(_slice_config()), lengths, work),
            }
        if "lookup" in parts:
            progress("(b) lookup cost")
            results.lookup = lookup_cost(lookup_counts, work, calls=50 if quick else 200)
        if "restart" in parts:
            if restart_model.startswith("slice"):  # "slice", or "slice:16" for 16 routed experts
                from benchmarks.slice_model import slice_for

                _, path, label = slice_for(restart_model)
                model = str(path)
            else:
                model, label = restart_model, restart_model
            progress(f"(c) restart restore ({label}, {args.restart_length} tokens)")
            results.restart = restart_restore(args, model, label, work)
    results.load_average_end = os.getloadavg()
    results.wall_s = time.perf_counter() - started
    out = results.to_json()
    out["table_markdown"] = tables(results)
    if results.throughput and results.lookup:
        plot(results, results_dir / f"{name}.png")
        out["plots"] = [f"{name}.png"]
    (results_dir / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
    progress(f"wrote {results_dir / name}.json")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2k/8k, restart on the default model at 2k")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to run")
    ap.add_argument(
        "--restart-model", help='model of (c): "ds4", "slice", "slice:N" (N routed experts), a path'
    )
    ap.add_argument("--restart-length", type=int, help="prompt tokens of (c)")
    ap.add_argument("--name", default="micro", help="result file name (<name>.json, <name>.png)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR / time.strftime("%Y-%m-%d"))
    # internal: one engine phase of (c) in this process
    ap.add_argument("--phase", choices=["cold", "restored"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        Path(args.result_file).write_text(json.dumps(phase(args)))
        return
    run(
        args.results_dir,
        args.quick,
        parts=args.parts,
        restart_model=args.restart_model,
        restart_length=args.restart_length,
        name=args.name,
    )


if __name__ == "__main__":
    main()
