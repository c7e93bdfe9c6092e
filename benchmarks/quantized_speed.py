"""Prefill and decode speed of the quantized path (ds4-tiny-q2 / ds4-tiny-q4 GGUF) against the same
model with dequantized float weights, side by side in one run, and load time against file size
(issue 8).

    .venv/bin/python -m benchmarks.quantized_speed                       # defaults below
    .venv/bin/python -m benchmarks.quantized_speed --quant q2 --prefill 512 --batch 1

For each quant, the float side is the GGUF dequantized by gguf-py (`tests/model/
quantized_checkpoints.py`) and written as a safetensors directory with the GGUF's own config, so
both engines run the same model (official numerics on, as for any GGUF) and only the weight
storage differs: packed blocks used through the fused kernels (`quant/fused.py`) or dequantized
on use vs float32 tensors. A third engine serves the GGUF with torch.compile off
(``TORCH_COMPILE_DISABLE=1``: no fused kernels, every packed weight dequantized on use), the
path before the kernels, for their before/after ratio. Prefill and decode are
measured as in bench_model.py (best of --repeats, after a warm-up). Load time is
`Ds4ForCausalLM.load_weights` over the file in this process (GGUF: memory-mapped, no engine);
engine start-up is `LLM(...)` wall time. Writes benchmarks/results/quantized_speed.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_model import run_side, vllm_generate
from benchmarks.reporting import machine_info, make_engine, print_table, shutdown_engine
from benchmarks.reporting import write_json as write_results


def dequantized_dir(gguf_path: Path, dest: Path) -> Path:
    """The GGUF's weights as float32 safetensors under native names, with its config and tokenizer."""
    from ds4_vllm.model.gguf_file import Ds4GgufFile
    from ds4_vllm.model.gguf_serving import gguf_tokenizer_dir
    from tests.model.quantized_checkpoints import gguf_reference_weights, write_float_checkpoint

    config = Ds4GgufFile.open(gguf_path).config()
    return write_float_checkpoint(
        dest, gguf_reference_weights(gguf_path), config, gguf_tokenizer_dir(gguf_path)
    )


def load_seconds(model_path: Path) -> float:
    """Wall time of building the model and loading the file into it, without an engine (what
    `Ds4ForCausalLM` does: the core, then vLLM's CPU kernels bound)."""
    import torch
    from safetensors.torch import safe_open

    from ds4_vllm.model.config import Ds4Config
    from ds4_vllm.model.core import build_model
    from ds4_vllm.model.cpu_kernels import use_vllm_cpu_kernels
    from ds4_vllm.model.gguf_file import Ds4GgufFile

    started = time.perf_counter()
    if model_path.is_file():
        gguf = Ds4GgufFile.open(model_path)
        config, weights = gguf.config(), gguf.tensors()
    else:
        config = Ds4Config.from_pretrained(model_path)
        handle = safe_open(str(model_path / "model.safetensors"), framework="pt")
        weights = ((name, handle.get_tensor(name)) for name in handle.keys())  # noqa: SIM118
    model = build_model(config, torch.float32)
    model.load_weights(weights)
    use_vllm_cpu_kernels(model)  # as Ds4ForCausalLM.load_weights does
    return time.perf_counter() - started


def file_bytes(model_path: Path) -> int:
    return (
        model_path.stat().st_size
        if model_path.is_file()
        else sum(p.stat().st_size for p in model_path.iterdir())
    )


@contextlib.contextmanager
def environment(name: str, value: str | None):
    """``name`` set to ``value`` (unset for None) for engines started inside, then restored."""
    saved = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


def measure(model_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    load_s = min(load_seconds(model_path) for _ in range(args.repeats))
    started = time.perf_counter()
    max_len = max([*args.prefill, args.decode_prompt + args.decode_tokens]) + 16
    llm = make_engine(
        model=str(model_path),
        max_model_len=max_len,
        max_num_batched_tokens=max(2048, max_len),
        enable_prefix_caching=False,
    )
    startup_s = time.perf_counter() - started
    try:
        speed = run_side(
            lambda p, n: vllm_generate(llm, p, n),
            args.prefill,
            args.batch,
            args.decode_prompt,
            args.decode_tokens,
            args.repeats,
        )
    finally:
        shutdown_engine(llm)
    return {"file_bytes": file_bytes(model_path), "load_s": load_s, "engine_startup_s": startup_s, **speed}


def main() -> None:
    from ds4_vllm.model.tiny_gguf import tiny_gguf_file

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", nargs="+", default=["q2", "q4"], choices=["q2", "q4"])
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2048], help="prompt lengths for prefill")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    ap.add_argument("--decode-prompt", type=int, default=128, help="prompt length of the decode runs")
    ap.add_argument("--decode-tokens", type=int, default=32, help="new tokens per decode request")
    ap.add_argument("--repeats", type=int, default=2, help="best of N runs per measurement")
    ap.add_argument("--output", default="quantized_speed.json", help="file name under benchmarks/results/")
    args = ap.parse_args()

    info = machine_info()
    t_start = time.perf_counter()
    results: dict[str, Any] = {}
    rows: list[list[Any]] = []
    with tempfile.TemporaryDirectory(prefix="ds4-dequantized-") as tmp:
        for quant in args.quant:
            gguf_path = tiny_gguf_file(f"ds4-tiny-{quant}")
            float_path = dequantized_dir(gguf_path, Path(tmp) / quant)
            print(f"ds4-tiny-{quant} GGUF (packed):", flush=True)
            with environment("TORCH_COMPILE_DISABLE", None):
                packed = measure(gguf_path, args)
            print(f"ds4-tiny-{quant} GGUF, torch.compile off (no fused kernels):", flush=True)
            with environment("TORCH_COMPILE_DISABLE", "1"):
                unfused = measure(gguf_path, args)
            print(f"ds4-tiny-{quant} dequantized (float32 safetensors):", flush=True)
            dense = measure(float_path, args)
            results[quant] = {"gguf": packed, "gguf_unfused": unfused, "float": dense}

            def row(label: str, p: float, u: float, d: float, quant: str = quant) -> list[Any]:
                return [quant, label, p, u, d, p / d, p / u]

            for n in args.prefill:
                p, u, d = (side["prefill"][str(n)]["tokens_per_s"] for side in (packed, unfused, dense))
                rows.append(row(f"prefill {n}", p, u, d))
            for b in args.batch:
                p, u, d = (side["decode"][str(b)] for side in (packed, unfused, dense))
                tokens = [side.pop("tokens") for side in (p, u, d)]
                same = sum(x == y for x, y in zip(tokens[0], tokens[2], strict=True))
                results[quant][f"decode_{b}_greedy_sequences_identical"] = f"{same}/{b}"
                rows.append(row(f"decode batch {b}", p["tokens_per_s"], u["tokens_per_s"], d["tokens_per_s"]))
            rows.append(row("load (s)", packed["load_s"], unfused["load_s"], dense["load_s"]))
            rows.append(row("file (MiB)", *(side["file_bytes"] / 2**20 for side in (packed, unfused, dense))))

    table = print_table(
        "Quantized GGUF vs the same weights dequantized (tokens/s unless stated)",
        [
            "quant",
            "measurement",
            "GGUF (packed)",
            "GGUF, no fused kernels",
            "float32 safetensors",
            "GGUF / float",
            "fused / not",
        ],
        rows,
    )
    write_results(
        args.output,
        {
            "benchmark": "quantized_speed",
            "machine": info,
            "settings": {
                "quants": args.quant,
                "prefill_lengths": args.prefill,
                "decode_batches": args.batch,
                "decode_prompt_tokens": args.decode_prompt,
                "decode_new_tokens": args.decode_tokens,
                "repeats": args.repeats,
                "vllm": "LLM(model=..., dtype='float32', enforce_eager=True, enable_prefix_caching=False)",
            },
            "results": results,
            "table_markdown": table,
            "wall_s": time.perf_counter() - t_start,
        },
    )


if __name__ == "__main__":
    main()
