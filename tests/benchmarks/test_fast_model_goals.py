"""Issue 19: how `fast_model_goals` turns the benchmarks' result files into goals and verdicts.

Pure logic on result files written by hand in the shapes the benchmarks write (the keys they
read are the ones `decode_step.py`, `compiled_decode.py`, `quantized_speed.py` and
`engine_compare.py` write).
"""

from __future__ import annotations

import pytest

from benchmarks.fast_model_goals import goals, render


def decode(dtype: str, ms1: float, read_ms: float, ms8: float | None = None) -> dict:
    rows = [
        {
            "dtype": dtype,
            "kernels": "torch",
            "batch": 1,
            "ms_per_step": 99.0,
            "read_ms": read_ms,
            "active_weight_bytes": 10**9,
            "step_over_read": 99.0 / read_ms,
        },
        {
            "dtype": dtype,
            "kernels": "vllm",
            "batch": 1,
            "ms_per_step": ms1,
            "read_ms": read_ms,
            "active_weight_bytes": 10**9,
            "step_over_read": ms1 / read_ms,
        },
    ]
    if ms8 is not None:
        rows.append(
            {
                "dtype": dtype,
                "kernels": "vllm",
                "batch": 8,
                "ms_per_step": ms8,
                "read_ms": read_ms,
                "active_weight_bytes": 10**9,
                "step_over_read": None,
                "throughput_over_batch1": 8 * ms1 / ms8,
            }
        )
    return {"rows": rows, "read_bandwidth_gb_s": 40.0, "profiles": {"bfloat16 vllm": "TOP-OPS"}}


COMPILED = {
    "runs": {
        "eager": {
            "start_s": 20.0,
            "decode_ms": {"1": [30.0, 31.0, 29.0], "8": [80.0, 80.0, 80.0]},
            "tokens": [[1, 2, 3], [4, 5, 6]],
        },
        "compiled, cold caches": {"start_s": 150.0, "decode_ms": {"1": [10.0], "8": [40.0]}},
        "compiled, warm caches": {
            "start_s": 35.0,
            "decode_ms": {"1": [12.0, 12.0, 11.0], "8": [40.0, 41.0, 39.0]},
            "tokens": [[1, 2, 3], [4, 5, 6]],
        },
        "eager again": {"start_s": 22.0, "decode_ms": {"1": [30.0, 30.0, 30.0], "8": [80.0, 80.0, 80.0]}},
    },
    "same_tokens": True,
}
QUANTIZED = {
    "results": {
        "q2": {
            "gguf": {"decode": {"1": {"tokens_per_s": 45.0}, "8": {"tokens_per_s": 100.0}}},
            "float": {"decode": {"1": {"tokens_per_s": 50.0}, "8": {"tokens_per_s": 200.0}}},
        }
    }
}
ENGINE = {
    "settings": {"context": 2048},
    "file_bytes": 4 * 2**30,
    "engine": {"prefill_tokens_per_s": 2.048, "decode_tokens_per_s": 4.0, "peak_rss_bytes": 5 * 2**30},
    "ours": {"prefill_s": 250.0, "decode_step_ms": 200.0, "peak_rss_bytes": 5 * 2**30},
}


def by_goal(found):
    return {g.goal: g for g in found}


def test_every_goal_from_a_full_run() -> None:
    found = by_goal(
        goals(
            {
                "decode_tiny": decode("bfloat16", 30.0, 10.0, 60.0),
                "decode_slice": decode("float32", 190.0, 100.0),
                "compiled": COMPILED,
                "quantized": QUANTIZED,
                "engine": ENGINE,
            }
        )
    )
    assert len(found) == 12
    # compiled: eager is the median of both eager engines (30.0), compiled the warm engine's (12.0)
    expected = {
        "batch-1 step over its active weights' read time, tiny default (bf16)": (3.0, False, "3.00x"),
        "the same on the real-width slice (q2)": (1.9, True, "1.90x"),
        "compiled batch-1 decode over enforce_eager": (2.5, True, "2.50x"),
        "compiled batch-8 decode over enforce_eager": (2.0, True, "2.00x"),
        "batch-8 decode tokens/s over batch 1": (8 * 12.0 / 40.0, False, "2.40x"),
        "cold start's compilation (s more than eager)": (129.0, False, "+129.0 s"),
        "warm start (s more than eager)": (14.0, True, "+14.0 s"),
        "compiled and eager give the same tokens": (1.0, True, "yes"),
        "ds4-tiny-q2 batch-1 decode over its float32 twin": (0.9, True, "0.90x"),
        "slice peak resident memory over the GGUF's size (2k prefill and decode)": (1.25, True, "1.25x"),
        "slice batch-1 decode at 2k over the ds4 engine's": (0.8, True, "0.80x"),
    }
    assert {name: (found[name].ratio, found[name].met, found[name].measured) for name in expected} == expected
    assert found["batch-8 decode tokens/s over batch 1"].detail.endswith(
        "the model alone (decode_step.json, eager): 4.00x"
    )
    assert found["compiled and eager give the same tokens"].detail.startswith(
        "tiny default, bf16, greedy: 0 of 2 requests of 3 tokens differ ("
    )
    assert found["ds4-tiny-q2 batch-1 decode over its float32 twin"].detail == "batch 8: 0.50x"
    prefill = found["slice 2k prefill time over the ds4 engine's"]
    assert prefill.ratio == pytest.approx(0.25)
    assert prefill.met is True


def test_steps_not_run_are_not_measured_and_render_says_so() -> None:
    parted = {**COMPILED["runs"]["compiled, warm caches"], "tokens": [[1, 2, 3], [4, 7, 6]]}
    results = {
        "compiled": {
            **COMPILED,
            "runs": {**COMPILED["runs"], "compiled, warm caches": parted},
            "same_tokens": False,
        }
    }
    found = goals(results)
    assert [g.met for g in found if g.source != "compiled_decode.json"] == [None] * 6
    same = by_goal(found)["compiled and eager give the same tokens"]
    assert (same.met, same.measured) == (False, "no")
    assert same.detail.startswith(
        "tiny default, bf16, greedy: 1 of 2 requests of 3 tokens differ; they part at steps 1 ("
    )
    text = render(found, results)
    assert text.count("not measured in this run") == 6
    assert "- engine: not run" in text
    assert "TOP-OPS" not in text


def test_render_includes_the_profiles_it_has() -> None:
    results = {"decode_tiny": decode("bfloat16", 30.0, 10.0, 60.0)}
    assert "the fast path (after):\n\n```\nTOP-OPS\n```" in render(goals(results), results)
