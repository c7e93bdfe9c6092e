"""The model's decode step against the memory-read limit, and batch 8 against batch 1 (issue 19).

    .venv/bin/python -m benchmarks.decode_step                 # bf16 and float32, batch 1 and 8
    .venv/bin/python -m benchmarks.decode_step --dtype bfloat16 --batch 1 --steps 10 --repeats 2
    .venv/bin/python -m benchmarks.decode_step --model ds4-tiny-q2 --dtype float32 --profile
    .venv/bin/python -m benchmarks.decode_step --model slice:16 --dtype float32 --batch 1 --context 512

``--model``: the tiny default (``ds4``), a tiny GGUF (``ds4-tiny-q2``) or the real-width slice
(``slice[:N]``, `slice_model.py`), its weights packed as served. The model runs directly (`ds4_vllm.model.paged_run.PagedRun`: paged caches and
metadata as vLLM's runner makes them, no engine; the model built as vLLM builds it,
`ds4_vllm.model.core.build_model`), each request prefilled to ``--context`` tokens, then decode
steps of the whole batch, logits included. The dtypes and batch sizes alternate within each repeat,
and so do the model's two paths: with vLLM's CPU kernels (`ds4_vllm.model.cpu_kernels`: its GEMM
for the projections, its fused mHC kernels; what `Ds4ForCausalLM` runs in vLLM since 2026-12-07)
and the portable PyTorch reference (what it ran before). For packed weights the fast paths are
the fused dequantize-and-multiply kernels (`quant/fused.py`) and the reference dequantizes on use.
``--profile`` adds torch.profiler's top operators of ``--steps`` batch-1 steps per path.

Against the physical limit: a batch-1 step must read its active weights once (every weight but
the embedding, with the routed experts counted at top-k / n_experts of their bytes, as one token
selects them, and the LM head). The read bandwidth is measured in the same run (`torch.sum`
over a 1 GiB buffer, best of 5); the report gives step time / read time (issue 19's goal: 2x or
less) and the batch-8 / batch-1 throughput ratio (goal: 4x or more).

Writes ``decode_step.json`` into ``--results-dir`` (default ``benchmarks/results/<YYYY-MM-DD>/``).
Times depend on the machine's load (recorded); read the ratios. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.reporting import RESULTS_DIR, machine_info, print_table

BANDWIDTH_BYTES = 1 << 30


def load_model(dtype: torch.dtype, kernels: str = "vllm", name: str = "ds4"):
    """A model as `Ds4ForCausalLM` runs it in vLLM (``kernels`` "vllm": vLLM's CPU kernels and the
    fused kernels for packed weights bound, `ds4_vllm.model.cpu_kernels`), or its PyTorch
    reference (``kernels`` "torch"). ``name``: "ds4", a tiny GGUF ("ds4-tiny-q2") or "slice[:N]"."""
    from safetensors.torch import load_file

    from ds4_vllm.model.core import build_model
    from ds4_vllm.model.cpu_kernels import use_vllm_cpu_kernels
    from ds4_vllm.model.default_model import default_config, default_model_dir

    if name == "ds4":
        model = build_model(default_config(), dtype)
        model.load_weights(load_file(str(default_model_dir() / "model.safetensors")).items())
    else:
        from ds4_vllm.model.gguf_file import Ds4GgufFile

        if name.startswith("slice"):
            from benchmarks.slice_model import slice_for

            path = slice_for(name)[1]
        else:
            from ds4_vllm.model.tiny_gguf import tiny_gguf_file

            path = tiny_gguf_file(name)
        gguf = Ds4GgufFile.open(path)
        model = build_model(gguf.config(), dtype)
        model.load_weights(gguf.tensors())
    if kernels == "vllm":
        use_vllm_cpu_kernels(model)
    return model.eval()


def active_weight_bytes(model) -> int:
    """Bytes a batch-1 decode step reads: all weights but the embedding, routed experts at k/E."""
    from ds4_vllm.model.quant.modules import QuantExpertWeight

    config = model.config
    share = config.num_experts_per_tok / config.n_routed_experts
    total = 0
    seen: set[int] = set()
    for name, module in model.named_modules():
        if "embed" in name:
            continue
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            nbytes = tensor.numel() * tensor.element_size()
            total += int(nbytes * share) if isinstance(module, QuantExpertWeight) else nbytes
    return total


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second `torch.sum` reads from a buffer far larger than the caches (best of n)."""
    buffer = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        float(buffer.sum())
        best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BYTES / best


class DecodeRun:
    """One model's batch of requests prefilled to ``context`` tokens, stepped on demand."""

    def __init__(self, model, batch: int, context: int, capacity: int) -> None:
        from ds4_vllm.model.paged_run import PagedRun

        g = torch.Generator().manual_seed(0)
        self.model, self.batch = model, batch
        self.run = PagedRun(model, capacity, batch, "cpu")
        self.requests = list(range(batch))
        with torch.inference_mode():
            for r in self.requests:
                self.run.hidden([torch.randint(1000, 100000, (context,), generator=g).tolist()], [r])
            self.steps(1)  # warm-up

    def steps(self, n: int) -> float:
        """ms per decode step of the whole batch, logits included, over ``n`` steps."""
        tokens = [[5] for _ in self.requests]
        start = time.perf_counter()
        with torch.inference_mode():
            for _ in range(n):
                self.model.compute_logits(self.run.hidden(tokens, self.requests))
        return (time.perf_counter() - start) / n * 1e3


def profile(decode: DecodeRun, steps: int, rows: int = 15) -> str:
    """torch.profiler's operators of ``steps`` decode steps, by self CPU time (ms per step)."""
    with torch.profiler.profile() as prof:
        decode.steps(steps)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return f"{steps} steps:\n{table}"


def run(
    dtypes: list[str],
    batches: list[int],
    context: int,
    steps: int,
    repeats: int,
    kernel_sets: list[str],
    model_name: str = "ds4",
    with_profile: bool = False,
) -> dict[str, Any]:
    bandwidth = read_bandwidth()
    models = {(d, g): load_model(getattr(torch, d), g, model_name) for d in dtypes for g in kernel_sets}
    capacity = context + (repeats + 2) * steps + 8
    runs = {(d, g, b): DecodeRun(models[(d, g)], b, context, capacity) for (d, g) in models for b in batches}
    times: dict[tuple[str, str, int], list[float]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, decode in runs.items():
            times[key].append(decode.steps(steps))
    rows = []
    for (dtype_name, kernels, batch), values in times.items():
        ms = statistics.median(values)
        active = active_weight_bytes(models[(dtype_name, kernels)])
        read_ms = active / bandwidth * 1e3
        batch1 = (
            statistics.median(times[(dtype_name, kernels, 1)]) if (dtype_name, kernels, 1) in times else None
        )
        torch_ms = times.get((dtype_name, "torch", batch))
        rows.append(
            {
                "dtype": dtype_name,
                "kernels": kernels,
                "batch": batch,
                "ms_per_step": ms,
                "ms_per_step_all": values,
                "tokens_per_s": batch / ms * 1e3,
                "active_weight_bytes": active,
                "read_ms": read_ms,
                "step_over_read": ms / read_ms if batch == 1 else None,
                "throughput_over_batch1": batch * batch1 / ms if batch1 and batch > 1 else None,
                "speedup_over_reference": statistics.median(torch_ms) / ms
                if torch_ms and kernels != "torch"
                else None,
            }
        )
    profiles = {
        f"{dtype_name} {kernels}": profile(decode, steps)
        for (dtype_name, kernels, batch), decode in runs.items()
        if with_profile and batch == 1
    }
    for label, table in profiles.items():
        print(f"profile, {label}, batch 1, {table}")
    return {
        "machine": machine_info(),
        "model": model_name,
        "profiles": profiles,
        "context": context,
        "steps": steps,
        "repeats": repeats,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", nargs="+", default=["vllm", "torch"], choices=["vllm", "torch"])
    parser.add_argument("--model", default="ds4", help='"ds4", "ds4-tiny-q2" or "slice[:N]"')
    parser.add_argument("--profile", action="store_true", help="top operators of batch-1 steps per path")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR / datetime.date.today().isoformat())
    args = parser.parse_args()
    results = run(
        args.dtype, args.batch, args.context, args.steps, args.repeats, args.kernels, args.model, args.profile
    )
    print_table(
        f"Decode step, {args.model}, context {args.context}, read bandwidth "
        f"{results['read_bandwidth_gb_s']:.1f} GB/s",
        [
            "dtype",
            "kernels",
            "batch",
            "ms/step",
            "tok/s",
            "active MB",
            "read ms",
            "step / read",
            "b8/b1",
            "vs reference",
        ],
        [
            [
                r["dtype"],
                r["kernels"],
                r["batch"],
                f"{r['ms_per_step']:.1f}",
                f"{r['tokens_per_s']:.0f}",
                f"{r['active_weight_bytes'] / 1e6:.0f}",
                f"{r['read_ms']:.2f}",
                "" if r["step_over_read"] is None else f"{r['step_over_read']:.1f}x",
                "" if r["throughput_over_batch1"] is None else f"{r['throughput_over_batch1']:.2f}x",
                "" if r["speedup_over_reference"] is None else f"{r['speedup_over_reference']:.2f}x",
            ]
            for r in results["rows"]
        ],
    )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.model == "ds4" else "_" + args.model.replace(":", "")
    path = args.results_dir / f"decode_step{suffix}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
