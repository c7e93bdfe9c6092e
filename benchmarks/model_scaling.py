"""Prefill scaling and the batch-1 decode step of `Ds4ForCausalLM`, against arithmetic (issue 11).

    .venv/bin/python -m benchmarks.model_scaling --quick          # 2k and 8k, a few minutes
    .venv/bin/python -m benchmarks.model_scaling --full           # 2k, 8k, 32k (+ reference at 8k)
    .venv/bin/python -m benchmarks.model_scaling --model slice:16 --lengths 2048 --repeats 1 --decode-tokens 9

Writes ``model_scaling.json`` and ``model_scaling_prefill.png`` (a slice: ``model_scaling_slice16.json``,
engine part only) into ``--results-dir``
(default ``benchmarks/results/<YYYY-MM-DD>/``). The report builder calls `run` directly.

- **Prefill scaling**: the model run directly (no engine: paged caches and metadata made
  by `ds4_vllm.model.paged_run.PagedRun`), in steps of ``CHUNK`` tokens as vLLM's scheduler
  chunks a prefill (``max_num_batched_tokens`` = 2,048 in the benchmarks). Median of
  ``repeats`` runs per length, next to `arithmetic.prefill_flops` with the same chunking; the
  8k→32k (quick: 2k→8k) time ratio is reported next to the predicted FLOP ratio.
- **Engine**: time to first token of a ``max_tokens=1`` request in `LLM` (prefill tokens/s) and
  the batch-1 decode step, split into our model's work (``Ds4ForCausalLM.forward`` +
  ``compute_logits``, timed inside the worker) and the rest of vLLM's step (scheduler, input
  preparation, sampler, output processing), both timed within each ``LLMEngine.step`` so that
  the share comes from the same steps. The engine core runs in-process for this
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the timer sees the worker's calls; on CPU every
  op is synchronous, so perf_counter around the forward is its compute time.
- **Reference**: transformers' eager `DeepseekV4ForCausalLM` on the same weights (default model
  only), prefill and decode, up to ``--max-reference-tokens``.

Times depend on the machine's load (recorded per measurement); read the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.arithmetic import prefill_flops, prefill_flops_by_component, token_flops
from benchmarks.reporting import (
    RESULTS_DIR,
    machine_info,
    make_engine,
    print_table,
    random_prompts,
    shutdown_engine,
    timed_generate,
)

CHUNK = 2048  # vLLM's max_num_batched_tokens in these benchmarks (and the ds4 engine's chunk)
QUICK_LENGTHS = (2048, 8192)
FULL_LENGTHS = (2048, 8192, 32768)
LONGEST_FULL = 131072  # asked for; run only where the model's position limit allows it
DECODE_CONTEXT = 2048
DECODE_TOKENS = 33


def load_average() -> float:
    return os.getloadavg()[0]


def median_of(fn: Callable[[], float], repeats: int) -> tuple[float, list[float]]:
    runs = [fn() for _ in range(repeats)]
    return statistics.median(runs), runs


# ------------------------------------------------------------------------------ direct prefill


def load_config(model: str) -> Any:
    """(config, path) of "ds4", "slice[:N]" (the real-width slice GGUF) or a model directory."""
    from ds4_vllm.model.config import Ds4Config
    from ds4_vllm.model.default_model import default_model_dir

    if model.startswith("slice"):
        from benchmarks.slice_model import slice_for

        config, path, _ = slice_for(model)
        return config, path
    path = default_model_dir() if model == "ds4" else Path(model)
    return Ds4Config.from_pretrained(str(path)), path


def build_direct_model(model: str) -> tuple[Any, Any]:
    """(The model outside an engine, its config) for the default model or a model directory: the
    core that `Ds4ForCausalLM` wraps, on vLLM's CPU kernels as it binds them, eager."""
    import torch
    from safetensors.torch import load_file

    from ds4_vllm.model.core import build_model
    from ds4_vllm.model.cpu_kernels import use_vllm_cpu_kernels

    config, path = load_config(model)
    net = build_model(config, torch.float32)
    for file in sorted(Path(path).glob("*.safetensors")):
        net.load_weights(load_file(str(file)).items())
    use_vllm_cpu_kernels(net)
    return net.eval(), config


def chunked_prefill(net: Any, token_ids: Any, chunk: int = CHUNK) -> Any:
    """Final hidden state of the last token after prefilling ``token_ids`` in steps of ``chunk``."""
    from ds4_vllm.model.paged_run import PagedRun

    ids = token_ids.tolist()
    run = PagedRun(net, len(ids), 1, "cpu")  # zeroed caches for the whole prompt
    hidden = None
    for start in range(0, len(ids), chunk):
        hidden = run.hidden([ids[start : start + chunk]], [0])
    return hidden[-1]


def prefill_scaling(
    net: Any, config: Any, lengths: Sequence[int], repeats: int, chunk: int = CHUNK
) -> dict[str, Any]:
    """Median prefill seconds per length against the arithmetic model, and the length ratios."""
    import torch

    chunked_prefill(net, torch.randint(1000, 100000, (min(lengths),)), chunk)  # warm-up
    rows = {}
    for n in lengths:
        prompts = iter(random_prompts([n] * repeats, seed=n))

        def once(prompts: Iterator[list[int]] = prompts) -> float:
            ids = torch.tensor(next(prompts))
            t0 = time.perf_counter()
            chunked_prefill(net, ids, chunk)
            return time.perf_counter() - t0

        load = load_average()
        seconds, runs = median_of(once, repeats)
        flops = prefill_flops(config, n, chunk)
        rows[str(n)] = {
            "seconds": seconds,
            "runs_s": runs,
            "tokens_per_s": n / seconds,
            "flops": flops,
            "gflops_per_s": flops / seconds / 1e9,
            "flops_by_component": prefill_flops_by_component(config, n, chunk),
            "load_average_1m": load,
        }
        print(
            f"  prefill {n}: {seconds:.2f} s (runs {[round(r, 2) for r in runs]}), load {load:.1f}",
            flush=True,
        )
    ratios = {}
    for a, b in zip(lengths, lengths[1:], strict=False):
        ra, rb = rows[str(a)], rows[str(b)]
        ratios[f"{a}->{b}"] = {
            "measured_time_ratio": rb["seconds"] / ra["seconds"],
            "predicted_flop_ratio": rb["flops"] / ra["flops"],
        }
    return {"chunk": chunk, "repeats": repeats, "lengths": rows, "ratios": ratios}


# ------------------------------------------------------------------------------ engine


class ModelTimer:
    """Times each engine step (``LLMEngine.step``) and our model's part of it, inside an in-process engine.

    Our part is ``Ds4ForCausalLM.forward`` + ``compute_logits`` (the LM head, kept apart: on the
    tiny default it reads a float32 head of 129,280 rows per token). A step whose forward carried
    one token is a batch-1 decode step; its time and its model time are kept per step, so the
    share is taken within the same steps (not from two runs that the machine's load may treat
    apart).
    """

    def __init__(self) -> None:
        self.decode_steps: list[tuple[float, float, float]] = []  # (step, model, LM head) s per step
        self._model_s = 0.0
        self._logits_s = 0.0
        self._tokens = 0

    def reset(self) -> None:
        self.decode_steps = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[ModelTimer]:
        from vllm.v1.engine.llm_engine import LLMEngine

        from ds4_vllm.model.model import Ds4ForCausalLM

        forward, logits, step = Ds4ForCausalLM.forward, Ds4ForCausalLM.compute_logits, LLMEngine.step
        timer = self

        def timed_forward(model, input_ids, positions, *args, **kwargs):
            t0 = time.perf_counter()
            out = forward(model, input_ids, positions, *args, **kwargs)
            timer._model_s += time.perf_counter() - t0
            timer._tokens = max(timer._tokens, int(positions.shape[0]))
            return out

        def timed_logits(model, hidden_states):
            t0 = time.perf_counter()
            out = logits(model, hidden_states)
            seconds = time.perf_counter() - t0
            timer._model_s += seconds
            timer._logits_s += seconds
            return out

        def timed_step(engine):
            timer._model_s, timer._logits_s, timer._tokens = 0.0, 0.0, 0
            t0 = time.perf_counter()
            out = step(engine)
            seconds = time.perf_counter() - t0
            if timer._tokens == 1:
                timer.decode_steps.append((seconds, timer._model_s, timer._logits_s))
            return out

        Ds4ForCausalLM.forward, Ds4ForCausalLM.compute_logits = timed_forward, timed_logits
        LLMEngine.step = timed_step
        try:
            yield self
        finally:
            Ds4ForCausalLM.forward, Ds4ForCausalLM.compute_logits = forward, logits
            LLMEngine.step = step


@contextlib.contextmanager
def in_process_engine_core() -> Iterator[None]:
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    old = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def engine_measurements(
    model: str,
    config: Any,
    lengths: Sequence[int],
    repeats: int,
    decode_context: int,
    decode_tokens: int,
    kv_cache_bytes: int | None = None,
    max_num_seqs: int | None = None,
) -> dict[str, Any]:
    """Engine prefill (TTFT) per length and the batch-1 decode step with our model's share.

    ``kv_cache_bytes``: vLLM's KV pool (default: the benchmarks' 2 GiB); ``max_num_seqs``: vLLM's
    batch limit (default: vLLM's, 256 on a CPU), whose dummy sampler run at start-up sizes
    its logits buffers. Both are part of the peak memory.
    """
    timer = ModelTimer()
    max_len = max([*lengths, decode_context + decode_tokens]) + 16
    pool = {} if kv_cache_bytes is None else {"kv_cache_memory_bytes": kv_cache_bytes}
    if max_num_seqs is not None:
        pool["max_num_seqs"] = max_num_seqs
    with in_process_engine_core(), timer.installed():
        llm = make_engine(model=model, max_model_len=max_len, enable_prefix_caching=False, **pool)
        try:
            timed_generate(llm, random_prompts([64], seed=1), 2)  # warm-up
            prefill = {}
            for n in lengths:
                prompts = iter(random_prompts([n] * repeats, seed=200 + n))
                load = load_average()
                seconds, runs = median_of(lambda p=prompts: timed_generate(llm, [next(p)], 1)[0], repeats)
                flops = prefill_flops(config, n, CHUNK)
                prefill[str(n)] = {
                    "ttft_s": seconds,
                    "runs_s": runs,
                    "tokens_per_s": n / seconds,
                    "gflops_per_s": flops / seconds / 1e9,
                    "load_average_1m": load,
                }
                print(f"  engine prefill {n}: {seconds:.2f} s, {n / seconds:.0f} tok/s", flush=True)
            decode = decode_step(llm, timer, config, decode_context, decode_tokens, repeats)
        finally:
            shutdown_engine(llm)
    # The engine core ran in this process: its weights, caches and transient buffers included.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"  peak resident memory: {peak_rss / 2**30:.2f} GiB", flush=True)
    return {"prefill": prefill, "decode_batch1": decode, "peak_rss_bytes": peak_rss}


def decode_step(
    llm: Any, timer: ModelTimer, config: Any, context: int, new_tokens: int, repeats: int
) -> dict[str, Any]:
    """Batch-1 decode step at ``context`` tokens: engine step time and our model's part of it.

    Per request, the medians over its decode steps; then the median over ``repeats`` requests.
    """
    prompts = random_prompts([context] * repeats, seed=7)
    timed_generate(llm, [prompts[0]], 2)  # warm-up at this shape
    steps, model_ms, head_ms, shares, loads = [], [], [], [], []
    for prompt in prompts:
        loads.append(load_average())
        timer.reset()
        timed_generate(llm, [prompt], new_tokens)
        runs = timer.decode_steps
        steps.append(1000 * statistics.median(s for s, _, _ in runs))
        model_ms.append(1000 * statistics.median(m for _, m, _ in runs))
        head_ms.append(1000 * statistics.median(h for _, _, h in runs))
        shares.append(statistics.median(m / s for s, m, _ in runs))
    step_ms, ours_ms, lm_head_ms = (
        statistics.median(steps),
        statistics.median(model_ms),
        statistics.median(head_ms),
    )
    result = {
        "context_tokens": context,
        "new_tokens": new_tokens,
        "step_ms": step_ms,
        "tokens_per_s": 1000 / step_ms,
        "model_ms": ours_ms,
        "vllm_ms": step_ms - ours_ms,
        "lm_head_ms": lm_head_ms,
        "lm_head_bytes": lm_head_bytes(llm),
        "memory_read_gb_per_s": memory_read_bandwidth(),
        "model_share": statistics.median(shares),
        "model_share_runs": shares,
        "step_ms_runs": steps,
        "model_ms_runs": model_ms,
        "flops_per_step": token_flops(config, context),
        "model_gflops_per_s": token_flops(config, context) / (ours_ms / 1000) / 1e9,
        "load_average_1m": statistics.median(loads),
    }
    print(
        f"  decode batch 1 at {context}: step {step_ms:.1f} ms = model {ours_ms:.1f} ms "
        f"({100 * ours_ms / step_ms:.0f}%; LM head {lm_head_ms:.1f} ms) + vLLM {step_ms - ours_ms:.1f} ms",
        flush=True,
    )
    return result


def lm_head_bytes(llm: Any) -> int:
    """Bytes of the LM head's weight as the model holds it (read once per decode step)."""
    from ds4_vllm.model.model import Ds4ForCausalLM

    def head_size(worker: Any) -> int:
        model = worker.model_runner.model
        assert isinstance(model, Ds4ForCausalLM)
        return model.lm_head.nbytes

    return int(llm.collective_rpc(head_size)[0])


def memory_read_bandwidth(n_bytes: int = 256 << 20) -> float:
    """GB/s of summing a float32 tensor of ``n_bytes`` (best of 5): the floor for a weight read."""
    import torch

    data = torch.ones(n_bytes // 4)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best / 1e9


# ------------------------------------------------------------------------------ reference


def reference_measurements(
    lengths: Sequence[int], repeats: int, context: int, new_tokens: int
) -> dict[str, Any]:
    """transformers' eager DeepseekV4ForCausalLM: prefill seconds per length and the decode step."""
    from benchmarks.bench_model import hf_generate, load_reference

    ref = load_reference()
    hf_generate(ref, random_prompts([64], seed=1), 2)  # warm-up
    prefill = {}
    for n in lengths:
        prompts = iter(random_prompts([n] * repeats, seed=300 + n))
        seconds, runs = median_of(lambda p=prompts: hf_generate(ref, [next(p)], 1)[0], repeats)
        prefill[str(n)] = {"ttft_s": seconds, "runs_s": runs, "tokens_per_s": n / seconds}
        print(f"  transformers prefill {n}: {seconds:.2f} s, {n / seconds:.0f} tok/s", flush=True)
    prompt = random_prompts([context], seed=7)
    steps = []
    for _ in range(repeats):
        first = hf_generate(ref, prompt, 1)[0]
        total = hf_generate(ref, prompt, new_tokens)[0]
        steps.append(1000 * (total - first) / (new_tokens - 1))
    step_ms = statistics.median(steps)
    print(f"  transformers decode batch 1 at {context}: {step_ms:.1f} ms/step", flush=True)
    return {
        "prefill": prefill,
        "decode_batch1": {"context_tokens": context, "step_ms": step_ms, "tokens_per_s": 1000 / step_ms},
    }


# ------------------------------------------------------------------------------ report


def plot_prefill(scaling: dict[str, Any], path: Path, title: str) -> Path:
    """Prefill time vs length, measured and predicted (FLOP-proportional, anchored at the shortest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [int(n) for n in scaling["lengths"]]
    measured = [scaling["lengths"][str(n)]["seconds"] for n in lengths]
    flops = [scaling["lengths"][str(n)]["flops"] for n in lengths]
    predicted = [measured[0] * f / flops[0] for f in flops]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(lengths, measured, "o-", label="measured (median)")
    ax.loglog(lengths, predicted, "s--", label="arithmetic (FLOPs, anchored at the shortest)")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill seconds")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def tables(result: dict[str, Any]) -> str:
    """The figures as Markdown: prefill scaling against arithmetic, engine prefill, decode step."""
    scaling = result.get("prefill_scaling")
    parts = []
    if scaling is not None:
        parts += [
            print_table(
                f"Prefill of `{result['settings']['model']}` (model run directly, chunks of "
                f"{scaling['chunk']}, median of {scaling['repeats']})",
                ["tokens", "seconds", "tokens/s", "TFLOP", "GFLOP/s"],
                [
                    [n, r["seconds"], r["tokens_per_s"], r["flops"] / 1e12, r["gflops_per_s"]]
                    for n, r in scaling["lengths"].items()
                ],
            ),
            print_table(
                "Prefill time ratios against the arithmetic",
                ["lengths", "measured time ratio", "arithmetic (FLOP) ratio", "measured / predicted"],
                [
                    [
                        pair,
                        r["measured_time_ratio"],
                        r["predicted_flop_ratio"],
                        r["measured_time_ratio"] / r["predicted_flop_ratio"],
                    ]
                    for pair, r in scaling["ratios"].items()
                ],
            ),
        ]
    engine = result.get("engine")
    if engine:
        ref = result.get("reference", {})
        rows = []
        for n, row in engine["prefill"].items():
            hf = ref.get("prefill", {}).get(n)
            rows.append(
                [n, row["ttft_s"], row["tokens_per_s"]]
                + ([hf["ttft_s"], hf["ttft_s"] / row["ttft_s"]] if hf else ["-", "-"])
            )
        parts.append(
            print_table(
                "In vLLM (time to first token) and against transformers",
                ["tokens", "vLLM TTFT s", "tokens/s", "transformers s", "vLLM / transformers speed"],
                rows,
            )
        )
        d = engine["decode_batch1"]
        parts.append(
            print_table(
                f"Batch-1 decode step at {d['context_tokens']} tokens of context (median)",
                [
                    "step ms",
                    "our model ms",
                    "of it LM head ms",
                    "vLLM's own ms",
                    "model share",
                    "LM head MB",
                    "memory read GB/s",
                    "LM head read at that rate, ms",
                ],
                [
                    [
                        d["step_ms"],
                        d["model_ms"],
                        d["lm_head_ms"],
                        d["vllm_ms"],
                        d["model_share"],
                        d["lm_head_bytes"] / 1e6,
                        d["memory_read_gb_per_s"],
                        1000 * d["lm_head_bytes"] / (d["memory_read_gb_per_s"] * 1e9),
                    ]
                ],
            )
        )
        if ref.get("decode_batch1"):
            step = ref["decode_batch1"]
            parts.append(f"transformers' decode step at {step['context_tokens']}: {step['step_ms']:.3g} ms.")
    return "\n\n".join(parts)


def default_results_dir() -> Path:
    return RESULTS_DIR / datetime.date.today().isoformat()


def run(
    results_dir: Path,
    quick: bool,
    model: str = "ds4",
    lengths: Sequence[int] | None = None,
    repeats: int = 3,
    engine: bool = True,
    reference: bool | None = None,
    max_reference_tokens: int | None = None,
    decode_context: int = DECODE_CONTEXT,
    decode_tokens: int = DECODE_TOKENS,
) -> dict[str, Any]:
    """Measure, write ``model_scaling.json`` and ``model_scaling_prefill.png`` into ``results_dir``.

    ``quick``: 2k and 8k; else 2k, 8k, 32k (128k only where the model's position limit allows).
    ``reference`` defaults to on for the default model (transformers has its weights) only.
    A slice ("slice[:N]") gets the engine part only: the direct harness of the prefill scaling
    loads safetensors directories, and the slice is a GGUF file.
    """
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    config, model_path = load_config(model)
    direct = not model.startswith("slice")
    if lengths is None:
        lengths = list(QUICK_LENGTHS if quick else FULL_LENGTHS)
        limit = int(getattr(config, "max_position_embeddings", 0) or 0)
        skipped = {}
        if not quick:
            if LONGEST_FULL < limit:
                lengths.append(LONGEST_FULL)
            else:
                skipped[str(LONGEST_FULL)] = f"above the model's max_position_embeddings ({limit})"
    else:
        skipped = {}
    lengths = sorted(lengths)
    if reference is None:
        reference = model == "ds4"
    if max_reference_tokens is None:
        max_reference_tokens = 2048 if quick else 8192
    result: dict[str, Any] = {
        "benchmark": "model_scaling",
        "machine": machine_info(),
        "settings": {
            "model": model,
            "quick": quick,
            "lengths": lengths,
            "skipped_lengths": skipped,
            "repeats": repeats,
            "chunk": CHUNK,
            "decode_context": decode_context,
            "decode_tokens": decode_tokens,
            "dtype": "float32",
        },
    }
    if direct:
        print(f"prefill scaling ({model}, direct, chunks of {CHUNK}):", flush=True)
        net, _ = build_direct_model(model)
        result["prefill_scaling"] = prefill_scaling(net, config, lengths, repeats)
        del net
    if engine:
        print("vLLM engine (in-process core):", flush=True)
        engine_model = model if model == "ds4" else str(model_path)
        result["engine"] = engine_measurements(
            engine_model, config, lengths, repeats, decode_context, decode_tokens
        )
    if reference:
        ref_lengths = [n for n in lengths if n <= max_reference_tokens]
        print(f"transformers reference (eager) at {ref_lengths}:", flush=True)
        result["reference"] = reference_measurements(
            ref_lengths, repeats, min(decode_context, max_reference_tokens), decode_tokens
        )
        result["reference"]["skipped_lengths"] = {
            str(n): f"above --max-reference-tokens {max_reference_tokens} (eager reference too slow here)"
            for n in lengths
            if n > max_reference_tokens
        }
    result["wall_s"] = time.perf_counter() - t_start
    name = f"model_scaling_{model.replace(':', '')}" if model.startswith("slice") else "model_scaling"
    result["plots"] = []
    if "prefill_scaling" in result:
        plot = plot_prefill(
            result["prefill_scaling"], results_dir / f"{name}_prefill.png", f"{model}: prefill time vs length"
        )
        result["plots"] = [plot.name]
    result["table_markdown"] = tables(result)
    out = results_dir / f"{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} and {result['plots']}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="2k and 8k (default)")
    mode.add_argument("--full", action="store_true", help="2k, 8k, 32k (and 128k where the model allows)")
    ap.add_argument("--model", default="ds4", help="'ds4' (default model) or a model directory, e.g. a slice")
    ap.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results/<date>/")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="override the prompt lengths")
    ap.add_argument("--repeats", type=int, default=3, help="median of N runs per measurement")
    ap.add_argument("--no-engine", action="store_true", help="skip the vLLM engine part")
    ap.add_argument("--no-reference", action="store_true", help="skip transformers' reference")
    ap.add_argument("--max-reference-tokens", type=int, default=None, help="longest reference prefill")
    ap.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help="new tokens per decode request")
    args = ap.parse_args()
    run(
        args.results_dir or default_results_dir(),
        quick=not args.full,
        model=args.model,
        lengths=args.lengths,
        repeats=args.repeats,
        engine=not args.no_engine,
        reference=False if args.no_reference else None,
        max_reference_tokens=args.max_reference_tokens,
        decode_tokens=args.decode_tokens,
    )


if __name__ == "__main__":
    main()
