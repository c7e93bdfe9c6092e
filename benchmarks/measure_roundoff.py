"""How far apart two float32 computations of the same answer land: the basis of the suite's tolerances.

A restored checkpoint plus the prefill of the rest must give the same log-probabilities as a
cold prefill, up to float32 summation order. How large is that round-off? This script measures
it on the default model, in one run:

- `restored_vs_cold`: engine B loads checkpoints written by engine A (cold and evict saves of
  prompts of 1,100 to 4,600 tokens) and answers follow-ups; engine R computes them cold. Both
  batch all follow-ups together.
- `batched_vs_alone`: engine R's batched answers against the same follow-ups sent one at a
  time. No checkpoint is involved: this is the noise of batch composition alone (GEMM
  blocking depends on the batch), the floor any restore comparison sits on.

For each, |Δ log-prob| over the reference's top-5 tokens at every decode step: count, median,
p99 and max. `python -m benchmarks.measure_roundoff` writes `benchmarks/results/roundoff.json`;
tests cite it where they set a tolerance.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import numpy as np

from benchmarks.reporting import (
    ds4disk_config,
    greedy,
    machine_info,
    make_engine,
    random_prompts,
    shutdown_engine,
    write_json,
)

LENGTHS = [1100, 2300, 3500, 4600]
MAX_TOKENS = 8


def generate(llm: Any, prompts: list[list[int]], *, alone: bool = False) -> list[Any]:
    params = greedy(MAX_TOKENS, logprobs=5)
    if alone:
        return [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def deltas(got: list[Any], want: list[Any]) -> list[float]:
    out: list[float] = []
    for g, w in zip(got, want, strict=True):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), "greedy tokens differ"
        for lp_g, lp_w in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            out += [abs(lp_g[t].logprob - lp.logprob) for t, lp in lp_w.items()]
    return out


def summary(values: list[float]) -> dict[str, float]:
    a = np.asarray(values)
    return {
        "count": int(a.size),
        "median": float(np.median(a)),
        "p99": float(np.quantile(a, 0.99)),
        "max": float(a.max()),
        "zeros": int((a == 0).sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=41)
    args = parser.parse_args()
    prompts = random_prompts(LENGTHS, seed=args.seed)
    tails = random_prompts([30] * (2 * len(LENGTHS)), seed=args.seed + 1)
    policy = {"kv_cache_boundary_align_tokens": 0}
    with tempfile.TemporaryDirectory(prefix="ds4-roundoff-") as directory:
        llm = make_engine(kv_transfer_config=ds4disk_config(directory, **policy), enable_prefix_caching=False)
        try:
            firsts = generate(llm, prompts)
        finally:
            shutdown_engine(llm)
        follow_ups = []
        for i, (p, f) in enumerate(zip(prompts, firsts, strict=True)):
            follow_ups.append(p + list(f.outputs[0].token_ids) + tails[2 * i])  # loads the evict save
            follow_ups.append(p[: len(p) - 32] + tails[2 * i + 1])  # loads the cold save (trimmed by 32)
        llm = make_engine(kv_transfer_config=ds4disk_config(directory, **policy), enable_prefix_caching=False)
        try:
            restored = generate(llm, follow_ups)
        finally:
            shutdown_engine(llm)
    assert all(r.num_cached_tokens > 0 for r in restored), [r.num_cached_tokens for r in restored]
    llm = make_engine(enable_prefix_caching=False)
    try:
        cold = generate(llm, follow_ups)
        alone = generate(llm, follow_ups, alone=True)
    finally:
        shutdown_engine(llm)
    result = {
        "machine": machine_info(),
        "lengths": LENGTHS,
        "loaded_tokens": [r.num_cached_tokens for r in restored],
        "restored_vs_cold": summary(deltas(restored, cold)),
        "batched_vs_alone": summary(deltas(cold, alone)),
    }
    for key in ("restored_vs_cold", "batched_vs_alone"):
        s = result[key]
        print(f"{key}: n={s['count']} median={s['median']:.2e} p99={s['p99']:.2e} max={s['max']:.2e}")
    write_json("roundoff.json", result)


if __name__ == "__main__":
    main()
