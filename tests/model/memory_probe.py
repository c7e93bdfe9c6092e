"""Serve one model in a fresh process and report the engine processes' memory as JSON.

    python -m tests.model.memory_probe MODEL [--prompt-tokens N] [--tensor-parallel-size N]

Starts `LLM(model=MODEL)` with the tests' engine settings, runs one greedy request of N random
tokens (enough that every routed expert of every layer is selected, so every page of the file
has been read), then prints one JSON line: for each process vLLM started (engine core, worker)
its name, peak resident memory (VmHWM) and current RSS split into file-backed and anonymous
pages, plus the engine's start-up wall time. Run in a subprocess so the caller's memory does not
count.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_STATUS_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def process_memory(pid: int) -> dict[str, int]:
    """Bytes of the /proc/PID/status memory fields (Linux)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in _STATUS_FIELDS:
            out[key] = int(value.split()[0]) * 1024
    return out


def engine_processes() -> list[dict]:
    import psutil

    rows = []
    for child in psutil.Process().children(recursive=True):
        try:
            rows.append({"pid": child.pid, "name": child.name(), **process_memory(child.pid)})
        except (psutil.NoSuchProcess, FileNotFoundError):
            continue
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    tp = args.tensor_parallel_size
    if tp > 1:
        from ds4_vllm.cli.cpu_parallel import tensor_parallel_env

        os.environ.update(tensor_parallel_env(tp))

    from tests.model.engine_helpers import greedy, make_engine, random_prompts, shutdown_engine

    started = time.perf_counter()
    llm = make_engine(
        model=args.model,
        dtype=args.dtype,
        max_model_len=4096,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=256 << 20,
        **({"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}),
    )
    startup_s = time.perf_counter() - started
    loaded = engine_processes()
    prompt = random_prompts([args.prompt_tokens], seed=5)[0]
    llm.generate([{"prompt_token_ids": prompt}], greedy(4), use_tqdm=False)
    served = engine_processes()
    shutdown_engine(llm)
    result = {
        "model": args.model,
        "file_bytes": Path(args.model).stat().st_size if Path(args.model).is_file() else None,
        "startup_s": startup_s,
        "after_load": loaded,
        "after_serving": served,
    }
    print("MEMORY_PROBE " + json.dumps(result), flush=True)


def parse_probe_output(text: str) -> dict:
    """The probe's JSON result from its combined output."""
    lines = [line for line in text.splitlines() if line.startswith("MEMORY_PROBE ")]
    if not lines:
        raise ValueError(f"memory probe printed no result; output ends with:\n{text[-3000:]}")
    return json.loads(lines[-1].removeprefix("MEMORY_PROBE "))


if __name__ == "__main__":  # python -m tests.model.memory_probe, from the repository root
    main()
