"""The model on a GPU, checked without vLLM (issue 25): correct, host syncs, graphs, speed, checkpoints.

    python scripts/gpu_check.py                  # on a machine with torch and CUDA
    python scripts/gpu_check.py --device cpu     # the same flow on the CPU (what CI runs)

Builds the tiny default model from its seed (no download) with the model core (`Ds4CausalLM`, no
vLLM), and drives it over paged states and per-step metadata made as vLLM's runner makes them:
block tables and query starts on the device, their host copies on the CPU, one metadata per
group of equal states. A batch of requests is prefilled in one step, then decoded step by step
with the tokens the CPU float32 reference picks, so every model sees the same inputs.

Prints a goal table (and writes `gpu_check.json` into `--out`):
  1. float32 on the device against the CPU reference (goal: max |diff| <= 1e-5); bf16 on the
     device against the reference, next to bf16 on the CPU against it (goal: not worse);
  2. host syncs of a decode step (`torch.cuda.set_sync_debug_mode`), each with its line;
  3. decode steps captured in CUDA graphs (batch 1 and the whole batch, `StaticDecode`) and
     replayed, full and padded as vLLM pads, against eager steps of the same tokens;
  4. ms per decode step at batch 1 and 8 (eager, graphed), kernel launches per step, and the
     batch's throughput over batch 1's;
  5. one request's state gathered into a `.kv` file and scattered back into other blocks, bit
     for bit, and decoding from it equal to decoding cold.
Exits 0 with "no GPU" where CUDA is absent; 1 when a correctness goal (1, 5) fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, not an install

from ds4_vllm.kvc import KvcHeader, PayloadData, PayloadHeader, SaveReason, open_checkpoint, write_checkpoint  # noqa: E402
from ds4_vllm.model.core import Ds4CausalLM, build_model  # noqa: E402
from ds4_vllm.model.default_model import default_config, default_model_dir  # noqa: E402
from ds4_vllm.model.kv_layout import Ds4KVLayout  # noqa: E402
from ds4_vllm.model.paged_run import PagedRun, StaticDecode  # noqa: E402

MAX_FP32_DIFF = 1e-5
GRAPHED = "graphed"


def build(dtype: torch.dtype, device: str) -> Ds4CausalLM:
    """The tiny default on `device`, built there and loaded from CPU tensors as vLLM does."""
    from safetensors.torch import load_file

    model = build_model(default_config(), dtype, device)
    model.load_weights(load_file(str(default_model_dir() / "model.safetensors")).items())
    return model.eval()


@dataclass
class Results:
    device: str
    torch_version: str
    gpu: str | None
    fp32_max_abs_diff: float | None = None
    bf16_device_max_abs_diff: float | None = None
    bf16_cpu_max_abs_diff: float | None = None
    bf16_device_p99_abs_diff: float | None = None
    bf16_cpu_p99_abs_diff: float | None = None
    host_syncs_per_decode_step: int | None = None
    host_sync_sites: list[str] = field(default_factory=list)
    sync_error: str | None = None
    graph_capture: str = "n/a"
    graph_replay_max_abs_diff: float | None = None
    ms_per_step: dict[str, float] = field(default_factory=dict)
    launches_per_step: dict[str, int] = field(default_factory=dict)
    kv_round_trip_bit_exact: bool | None = None
    restored_decode_equals_cold: bool | None = None

    @property
    def graphed_batch1_ms(self) -> float | None:
        return self.ms_per_step.get(f"batch 1, bf16, {GRAPHED}")

    @property
    def batch_throughput_ratio(self) -> float | None:
        """Tokens/s of the largest graphed batch over batch 1's."""
        graphed = {
            int(k.split()[1].rstrip(",")): v for k, v in self.ms_per_step.items() if k.endswith(GRAPHED)
        }
        if 1 not in graphed or len(graphed) < 2:
            return None
        n = max(graphed)
        return (n / graphed[n]) / (1 / graphed[1])

    @property
    def correct(self) -> bool:
        checks = [
            self.fp32_max_abs_diff is not None and self.fp32_max_abs_diff <= MAX_FP32_DIFF,
            self.bf16_device_p99_abs_diff is not None
            and self.bf16_cpu_max_abs_diff is not None
            and self.bf16_device_p99_abs_diff <= self.bf16_cpu_max_abs_diff,
            self.kv_round_trip_bit_exact is True,
            self.restored_decode_equals_cold is True,
            # a replay reads what an eager step reads; only kernel choices may differ (bf16 noise)
            self.graph_replay_max_abs_diff is not None
            and self.bf16_cpu_max_abs_diff is not None
            and self.graph_replay_max_abs_diff <= self.bf16_cpu_max_abs_diff,
        ]
        return all(checks)


def prompts(lengths: list[int], seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 120_000, n).tolist() for n in lengths]


def run_logits(model, device, batch_prompts, decode_tokens, capacity) -> list[torch.Tensor]:
    """Prefill all prompts in one step, then one step per decode token row (all requests)."""
    run = PagedRun(model, capacity, len(batch_prompts), device)
    requests = list(range(len(batch_prompts)))
    out = [run.step(batch_prompts, requests).cpu()]
    for row in decode_tokens:
        out.append(run.step([[t] for t in row], requests).cpu())
    return out


def max_and_p99(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    diff = torch.cat([(x - y).abs().flatten() for x, y in zip(a, b, strict=True)])
    return float(diff.max()), float(torch.quantile(diff[:: max(1, diff.numel() // 1_000_000)], 0.99))


def timed_median(step, steps: int, device: str) -> float:
    """Median ms of `steps` calls of `step`."""
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def count_launches(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def host_syncs(run: PagedRun, results: Results) -> None:
    """Count a batch-1 decode step's syncs ("warn" mode), then show the first as an error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run.step([[1000]], [0])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchronizing" in str(w.message).lower()]
    results.host_syncs_per_decode_step = len(syncs)
    results.host_sync_sites = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
    torch.cuda.set_sync_debug_mode("error")
    try:
        run.step([[1000]], [0])
    except RuntimeError as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "ds4_vllm" in f.filename]
        where = f"{frames[-1].filename.split('ds4_vllm/')[-1]}:{frames[-1].lineno}" if frames else "?"
        results.sync_error = f"{where}: {exc}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def graph_replays(model, device, batch_prompts, capacity, results: Results, timed: int) -> None:
    """Decode steps captured in CUDA graphs (batch 1 and the whole batch, `StaticDecode`) and
    replayed: against eager steps of the same tokens (a full batch, and a few requests padded to
    the batch as vLLM pads), then timed."""
    batch = len(batch_prompts)
    requests = list(range(batch))
    run = PagedRun(model, capacity, batch, device, static_seq_len=True)
    run.step(batch_prompts, requests)
    try:
        graphs = {1: StaticDecode(run, 1), batch: StaticDecode(run, batch)}
        results.graph_capture = (
            "captured"
            if graphs[1].graph is not None
            else "not captured (no CUDA): eager over the same buffers"
        )
    except Exception as exc:  # the table says why it failed
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "ds4_vllm" in f.filename]
        where = f"{frames[-1].filename.split('ds4_vllm/')[-1]}:{frames[-1].lineno}" if frames else "?"
        results.graph_capture = f"failed at {where}: {type(exc).__name__}: {str(exc)[:200]}"
        return
    diffs = []
    for graph, chosen in (
        (graphs[batch], requests),
        (graphs[batch], requests[: max(1, batch // 2)]),
        (graphs[1], [0]),
    ):
        tokens = [1000 + r for r in chosen]
        start = [run.seq_lens[r] for r in chosen]
        eager = run.step([[t] for t in tokens], chosen)
        for r, n in zip(chosen, start, strict=True):  # the same positions again: the same slots
            run.seq_lens[r] = n
        replayed = graph.step(tokens, chosen)
        diffs.append(float((replayed - eager).abs().max()))
    results.graph_replay_max_abs_diff = max(diffs)
    for label, n in ((f"batch 1, bf16, {GRAPHED}", 1), (f"batch {batch}, bf16, {GRAPHED}", batch)):
        step = lambda n=n: graphs[n].step([1000] * n, requests[:n])  # noqa: E731
        for _ in range(3):
            step()
        results.ms_per_step[label] = timed_median(step, timed, device)
        if device == "cuda":
            results.launches_per_step[label] = count_launches(step)


def kv_round_trip(model, device, prompt: list[int], results: Results, out: Path) -> None:
    """Gather one request's state into a .kv file, scatter it into other blocks, decode from both."""
    capacity = len(prompt) + 16
    cold = PagedRun(model, capacity, 1, device)
    cold.step([prompt], [0])
    layout = Ds4KVLayout(model.config, cold.role_of)
    n = len(prompt)
    arrays = layout.extract(cold.caches, cold.block_ids(0), n)
    n_comp, n_index = layout.counts(n)
    payload = PayloadData(
        header=PayloadHeader.build(layout.dims, ctx_size=capacity, n_tokens=n),
        tokens=np.asarray(prompt, dtype=np.uint32),
        logits=np.zeros(model.config.vocab_size, dtype=np.float32),
        n_comp=n_comp,
        n_index_comp=n_index,
        layers=arrays,
    )
    header = KvcHeader.new(quant_bits=2, reason=SaveReason.COLD, tokens=n, ctx_size=capacity)
    path = write_checkpoint(out, repr(prompt).encode(), header, payload, fsync=False)
    restored = PagedRun(model, capacity, 1, device, first_block=5)
    with open_checkpoint(path) as ck:
        layout.restore(restored.caches, restored.block_ids(0), ck.payload.layers, n)
    restored.seq_lens[0] = n
    again = layout.extract(restored.caches, restored.block_ids(0), n)
    results.kv_round_trip_bit_exact = all(
        all(
            np.array_equal(getattr(a, f), getattr(b, f))
            for f in a.__dataclass_fields__
            if getattr(a, f) is not None
        )
        for a, b in zip(arrays, again, strict=True)
    )
    same = True
    for token in (11, 22, 33, 44):
        same &= bool(torch.equal(cold.step([[token]], [0]), restored.step([[token]], [0])))
    results.restored_decode_equals_cold = same


def table(r: Results) -> str:
    def cell(v):
        if v is None:
            return "–"
        if isinstance(v, bool):
            return "yes" if v else "**no**"
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    rows = [
        ("float32 on the device vs CPU, max abs diff", cell(r.fp32_max_abs_diff), f"<= {MAX_FP32_DIFF:g}"),
        (
            "bf16 on the device vs CPU fp32: max / p99 abs diff",
            f"{cell(r.bf16_device_max_abs_diff)} / {cell(r.bf16_device_p99_abs_diff)}",
            f"p99 <= bf16-on-CPU max ({cell(r.bf16_cpu_max_abs_diff)}; its p99 {cell(r.bf16_cpu_p99_abs_diff)})",
        ),
        ("host syncs per batch-1 decode step", cell(r.host_syncs_per_decode_step), "0"),
        ("first sync (error mode)", cell(r.sync_error), "none"),
        ("CUDA graphs of decode steps (batch 1, whole batch)", r.graph_capture, "captured"),
        ("replay (full and padded batches) vs eager, max abs diff", cell(r.graph_replay_max_abs_diff), "0"),
        *((f"ms per step, {k}", cell(v), "") for k, v in r.ms_per_step.items()),
        (
            "batch-1 graphed step; batch-N throughput over batch 1",
            f"{cell(r.graphed_batch1_ms)} ms; {cell(r.batch_throughput_ratio)}x",
            "<= 1 ms (H200); >= 6x",
        ),
        *((f"kernel launches per step, {k}", cell(v), "") for k, v in r.launches_per_step.items()),
        (".kv gather + scatter bit for bit", cell(r.kv_round_trip_bit_exact), "yes"),
        ("decoding from the restore equals cold", cell(r.restored_decode_equals_cold), "yes"),
    ]
    head = f"# GPU check: {r.gpu or r.device}, torch {r.torch_version}\n\n| check | measured | goal |\n|---|---|---|\n"
    return head + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512, help="tokens of each prompt but the last")
    parser.add_argument(
        "--long-prompt", type=int, default=2304, help="the last prompt: past the indexer's top-k"
    )
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("gpu_check_results"))
    args = parser.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no GPU: CUDA is not available here, nothing checked")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results = Results(device, torch.__version__, torch.cuda.get_device_name() if device == "cuda" else None)

    lengths = [args.prompt] * (args.batch - 1) + [args.long_prompt]
    batch_prompts = prompts(lengths)
    capacity = max(lengths) + args.decode_steps + args.timed_steps + 64
    reference = build(torch.float32, "cpu")
    # The reference picks the decode tokens (greedy); every model is fed the same ones.
    run = PagedRun(reference, capacity, len(lengths), "cpu")
    ref = [run.step(batch_prompts, list(range(len(lengths))))]
    decode_tokens = []
    for _ in range(args.decode_steps):
        decode_tokens.append(ref[-1].argmax(-1).tolist())
        ref.append(run.step([[t] for t in decode_tokens[-1]], list(range(len(lengths)))))
    print(f"reference: {len(lengths)} prompts ({lengths}), {args.decode_steps} decode steps", flush=True)

    fp32 = run_logits(build(torch.float32, device), device, batch_prompts, decode_tokens, capacity)
    results.fp32_max_abs_diff = max_and_p99(fp32, ref)[0]
    bf16_model = build(torch.bfloat16, device)
    bf16 = run_logits(bf16_model, device, batch_prompts, decode_tokens, capacity)
    results.bf16_device_max_abs_diff, results.bf16_device_p99_abs_diff = max_and_p99(bf16, ref)
    bf16_cpu = run_logits(build(torch.bfloat16, "cpu"), "cpu", batch_prompts, decode_tokens, capacity)
    results.bf16_cpu_max_abs_diff, results.bf16_cpu_p99_abs_diff = max_and_p99(bf16_cpu, ref)
    print(
        f"correctness: fp32 {results.fp32_max_abs_diff:.3g}, bf16 {results.bf16_device_max_abs_diff:.3g}",
        flush=True,
    )

    timing = PagedRun(bf16_model, capacity, len(lengths), device)
    timing.step(batch_prompts, list(range(len(lengths))))
    for label, requests in (
        ("batch 1, bf16, eager", [0]),
        (f"batch {len(lengths)}, bf16, eager", list(range(len(lengths)))),
    ):
        step = lambda requests=requests: timing.step([[1000] for _ in requests], requests)  # noqa: E731
        timed_median(step, 3, device)  # warm-up
        results.ms_per_step[label] = timed_median(step, args.timed_steps, device)
        if device == "cuda":
            results.launches_per_step[label] = count_launches(step)
    if device == "cuda":
        host_syncs(timing, results)
    graph_replays(bf16_model, device, batch_prompts, capacity, results, args.timed_steps)
    kv_round_trip(bf16_model, device, batch_prompts[-1], results, args.out)

    text = table(results)
    print(text)
    (args.out / "gpu_check.md").write_text(text)
    (args.out / "gpu_check.json").write_text(
        json.dumps(
            asdict(results)
            | {
                "correct": results.correct,
                "graphed_batch1_ms": results.graphed_batch1_ms,
                "batch_throughput_ratio": results.batch_throughput_ratio,
            },
            indent=1,
        )
        + "\n"
    )
    return 0 if results.correct else 1


if __name__ == "__main__":
    raise SystemExit(main())
