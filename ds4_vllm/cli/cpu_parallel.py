"""The one CPU-only setting tensor parallelism needs (docs/tensor-parallel.md).

On CPU, vLLM 0.32 runs tensor-parallel ranks only with its `mp` executor (its CPU platform
refuses `--distributed-executor-backend ray`), and each rank needs its own cores in
`VLLM_CPU_OMP_THREADS_BIND` ("0-7|8-15": one set per rank, or "nobind"); its automatic binding
assumes a NUMA node per rank. On GPU neither applies: the same model code runs under any executor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_thread_binding(tp_size: int, cores: list[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each of ``tp_size`` ranks an equal contiguous share of ``cores``."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if tp_size < 1 or len(cores) < tp_size:
        raise ValueError(
            f"tensor parallel size {tp_size} needs at least {tp_size} CPU cores, this process has {len(cores)}"
        )
    per = len(cores) // tp_size
    sets = [cores[r * per : (r + 1) * per] for r in range(tp_size)]
    return "|".join(",".join(str(c) for c in s) for s in sets)


#: No pinning: vLLM leaves the ranks' threads to the OS scheduler.
NO_BINDING = "nobind"


def tensor_parallel_env(
    tp_size: int, environ: Mapping[str, str] | None = None, *, pin_cores: bool = True
) -> dict[str, str]:
    """Variables a CPU engine of ``tp_size`` ranks needs that ``environ`` does not set already.

    ``pin_cores``: give each rank its share of this process's cores (one engine on this
    machine). Off for engines placed elsewhere (Ray replicas): one fixed list would pin every
    replica on a node to the same cores, and the launcher's core ids may not exist there.
    """
    environ = os.environ if environ is None else environ
    if tp_size <= 1 or BIND_ENV in environ:
        return {}
    return {BIND_ENV: cpu_thread_binding(tp_size) if pin_cores else NO_BINDING}
