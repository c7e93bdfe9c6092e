"""Prefill and decode speed of the default `ds4` model in vLLM against transformers' eager
reference (`DeepseekV4ForCausalLM`), side by side in one run (issue 2).

    .venv/bin/python -m benchmarks.bench_model                      # defaults below
    .venv/bin/python -m benchmarks.bench_model --prefill 512 2048 --decode-tokens 64 --batch 1 8

Prefill: time to first token (a max_tokens=1 request) / prompt tokens.
Decode: (time for N new tokens - time for 1 new token) over the same prompts gives the time
of N-1 decode steps; tokens/s counts all requests of the batch. vLLM batches the requests of
one `generate` call; transformers runs `generate(..., use_cache=True)` on a [batch, len] tensor.
Each measurement is the best of --repeats runs (default 2), after warm-ups on each side.
Writes benchmarks/results/model.json.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.reporting import (
    machine_info,
    make_engine,
    print_table,
    random_prompts,
    shutdown_engine,
    timed_generate,
)
from benchmarks.reporting import write_json as write_results


def load_reference() -> Any:
    import torch
    from transformers import DeepseekV4ForCausalLM

    from ds4_vllm.model.config import Ds4Config, to_transformers_config
    from ds4_vllm.model.default_model import default_model_dir

    path = default_model_dir()
    config = to_transformers_config(Ds4Config.from_pretrained(path))
    return DeepseekV4ForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()


def hf_generate(model: Any, prompts: Sequence[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Wall time of transformers' greedy generate with the KV cache, and the new tokens."""
    import torch

    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
    seconds = time.perf_counter() - t0
    return seconds, out[:, ids.shape[1] :].tolist()


def vllm_generate(llm: Any, prompts: Sequence[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    seconds, outs = timed_generate(llm, prompts, new_tokens)
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def run_side(
    generate: Any,
    prefill: Sequence[int],
    batches: Sequence[int],
    decode_prompt: int,
    decode_tokens: int,
    repeats: int,
) -> dict[str, Any]:
    """Measure one implementation; `generate(prompts, new_tokens) -> (seconds, tokens)`."""
    generate(random_prompts([64], seed=1), 2)  # warm-up
    result: dict[str, Any] = {"prefill": {}, "decode": {}}
    for n in prefill:
        best = min(generate(random_prompts([n], seed=100 + n + r), 1)[0] for r in range(repeats))
        result["prefill"][str(n)] = {"ttft_s": best, "tokens_per_s": n / best}
        print(f"  prefill {n}: ttft {best:.3f} s, {n / best:.1f} tok/s", flush=True)
    for b in batches:
        prompts = random_prompts([decode_prompt] * b, seed=7)  # same prompts on both sides
        generate(prompts, 2)  # warm-up at this batch shape
        first = min(generate(prompts, 1)[0] for _ in range(repeats))
        runs = [generate(prompts, decode_tokens) for _ in range(repeats)]
        total = min(s for s, _ in runs)
        steps = decode_tokens - 1
        decode_s = max(total - first, 1e-9)
        result["decode"][str(b)] = {
            "first_token_s": first,
            "total_s": total,
            "decode_steps": steps,
            "step_ms": 1000 * decode_s / steps,
            "tokens_per_s": b * steps / decode_s,
            "tokens": runs[0][1],
        }
        print(
            f"  decode batch {b}: {1000 * decode_s / steps:.1f} ms/step, {b * steps / decode_s:.1f} tok/s",
            flush=True,
        )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2048], help="prompt lengths for prefill")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    ap.add_argument("--decode-prompt", type=int, default=128, help="prompt length of the decode runs")
    ap.add_argument("--decode-tokens", type=int, default=64, help="new tokens per decode request")
    ap.add_argument("--repeats", type=int, default=2, help="best of N runs per measurement")
    ap.add_argument("--output", default="model.json", help="file name under benchmarks/results/")
    args = ap.parse_args()

    info = machine_info()
    t_start = time.perf_counter()

    print("vLLM (Ds4ForCausalLM, enforce_eager, float32):", flush=True)
    max_len = max([*args.prefill, args.decode_prompt + args.decode_tokens]) + 16
    llm = make_engine(
        max_model_len=max_len, max_num_batched_tokens=max(2048, max_len), enable_prefix_caching=False
    )
    vllm_res = run_side(
        lambda p, n: vllm_generate(llm, p, n),
        args.prefill,
        args.batch,
        args.decode_prompt,
        args.decode_tokens,
        args.repeats,
    )
    shutdown_engine(llm)

    print("transformers (DeepseekV4ForCausalLM, eager, float32, generate use_cache=True):", flush=True)
    model = load_reference()
    hf_res = run_side(
        lambda p, n: hf_generate(model, p, n),
        args.prefill,
        args.batch,
        args.decode_prompt,
        args.decode_tokens,
        args.repeats,
    )

    rows: list[list[Any]] = []
    summary: dict[str, Any] = {"prefill": {}, "decode": {}}
    for n in args.prefill:
        v, h = vllm_res["prefill"][str(n)], hf_res["prefill"][str(n)]
        ratio = v["tokens_per_s"] / h["tokens_per_s"]
        summary["prefill"][str(n)] = {"vllm": v, "transformers": h, "ratio_vllm_over_transformers": ratio}
        rows.append([f"prefill {n} tokens (TTFT)", v["tokens_per_s"], h["tokens_per_s"], ratio])
    for b in args.batch:
        v, h = vllm_res["decode"][str(b)], hf_res["decode"][str(b)]
        ratio = v["tokens_per_s"] / h["tokens_per_s"]
        same = sum(a == c for a, c in zip(v.pop("tokens"), h.pop("tokens"), strict=True))
        summary["decode"][str(b)] = {
            "vllm": v,
            "transformers": h,
            "ratio_vllm_over_transformers": ratio,
            "greedy_sequences_identical": f"{same}/{b}",
        }
        rows.append(
            [f"decode batch {b} ({args.decode_tokens} tokens)", v["tokens_per_s"], h["tokens_per_s"], ratio]
        )

    table = print_table(
        "Default ds4 model: vLLM vs transformers (tokens/s)",
        ["measurement", "vLLM tok/s", "transformers tok/s", "vLLM / transformers"],
        rows,
    )
    write_results(
        args.output,
        {
            "benchmark": "bench_model",
            "machine": info,
            "settings": {
                "prefill_lengths": args.prefill,
                "decode_batches": args.batch,
                "decode_prompt_tokens": args.decode_prompt,
                "decode_new_tokens": args.decode_tokens,
                "repeats": args.repeats,
                "vllm": "LLM(model='ds4', dtype='float32', enforce_eager=True, enable_prefix_caching=False)",
                "transformers": "DeepseekV4ForCausalLM.generate(use_cache=True, do_sample=False)",
            },
            "results": summary,
            "table_markdown": table,
            "wall_s": time.perf_counter() - t_start,
        },
    )


if __name__ == "__main__":
    main()
