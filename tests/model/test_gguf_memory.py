"""Issue 8: serving a GGUF whose routed experts dominate needs resident memory close to the file's size.

Method. A 1.1 GiB ds4-layout q2 GGUF is generated (the default model's shape with 96 routed
experts of width 8,192: 87 % of the bytes are routed experts) and served by a real vLLM engine in
a fresh process (`tests.model.memory_probe`), which runs one 512-token request (every expert of
every layer is selected, so every page of the file has been read) and reports the peak resident
memory (VmHWM) of vLLM's worker, where the model lives. The same probe serves the embedded
`ds4-tiny-q2`: the same vocabulary, embedding, LM head, attention and KV cache, with 8 narrow
experts (118 MiB). vLLM's and torch's own memory, the fixed tensors and the KV cache are
common to both, so the difference of the two peaks is the memory the bigger weights cost,
transient dequantization buffers included; it must stay within 1.3x the difference of the file
sizes. Memory-mapped pages count once they are read; that is expected.

Measured (2 shared cores, float32): worker peak 2,416-2,471 MiB vs 1,388 MiB for the tiny file,
1,027-1,083 MiB for 1,007 MiB more file: 1.02-1.08x over two runs. With the routed experts dequantized in
512 MiB groups (the former `QuantExperts` budget) an 800 MiB file of this kind peaked at 2.06x.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model.memory_probe import parse_probe_output

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

PEAK_OVER_FILE_LIMIT = 1.3
#: Each of 2 ranks' share of one rank's extra peak: half, plus the dequantization buffers (one
#: 64 MiB group per rank, not halved) and the replicated tensors. Measured 0.53 and 0.54 (572 and
#: 582 MiB against 1,072 MiB); when each rank copied its part out of the map (anonymous pages on
#: top of the mapped pages the copy read) it was 1.04 and 1.06.
PER_RANK_LIMIT = 0.65
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def expert_heavy_gguf(tmp_path_factory):
    from ds4_vllm.model.config import Ds4Config
    from ds4_vllm.model.default_model import default_config
    from ds4_vllm.model.tiny_gguf import write_tiny_gguf

    config = Ds4Config.from_config_dict(
        {**default_config().to_dict(), "n_routed_experts": 96, "moe_intermediate_size": 8192}
    )
    path = write_tiny_gguf(tmp_path_factory.mktemp("memory") / "experts-q2.gguf", "q2", config=config)
    yield path
    path.unlink()  # 1.1 GiB: do not leave it in pytest's kept temp dirs


def worker_peaks(model: Path, cache: Path, tp: int = 1) -> tuple[list[int], dict]:
    """VmHWM bytes of each vLLM worker (one per rank) serving `model` in a fresh process, and the
    probe's result. `cache` receives the tokenizer directory written from the file (one per file path).
    """
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DS4_VLLM_CACHE": str(cache)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.model.memory_probe",
            str(model),
            "--prompt-tokens",
            "512",
            "--tensor-parallel-size",
            str(tp),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    result = parse_probe_output(done.stdout + done.stderr)
    workers = [p for p in result["after_serving"] if p["name"].startswith("VLLM::Worker")]
    assert len(workers) == tp, f"expected {tp} vLLM workers, found {result['after_serving']}"
    return [w["VmHWM"] for w in workers], result


def test_expert_heavy_gguf_is_served_within_1_3x_its_size(expert_heavy_gguf, tmp_path):
    import gguf

    from ds4_vllm.model.tiny_gguf import tiny_gguf_file

    tensors = gguf.GGUFReader(expert_heavy_gguf).tensors
    expert_bytes = sum(int(t.n_bytes) for t in tensors if "_exps." in t.name)
    assert expert_bytes > 0.8 * sum(int(t.n_bytes) for t in tensors)

    baseline = tiny_gguf_file("ds4-tiny-q2")
    (big_peak,), _ = worker_peaks(expert_heavy_gguf, tmp_path)
    (base_peak,), _ = worker_peaks(baseline, tmp_path)
    extra_file = expert_heavy_gguf.stat().st_size - baseline.stat().st_size
    ratio = (big_peak - base_peak) / extra_file
    print(
        f"worker peak {big_peak / 2**20:.0f} MiB vs {base_peak / 2**20:.0f} MiB (tiny): "
        f"{(big_peak - base_peak) / 2**20:.0f} MiB for {extra_file / 2**20:.0f} MiB more file = {ratio:.2f}x"
    )
    assert ratio <= PEAK_OVER_FILE_LIMIT, (
        f"serving {extra_file / 2**20:.0f} MiB more GGUF took {(big_peak - base_peak) / 2**20:.0f} MiB more "
        f"peak resident memory ({ratio:.2f}x, limit {PEAK_OVER_FILE_LIMIT}x)"
    )


def test_two_ranks_each_hold_about_half_of_the_weights(expert_heavy_gguf, tmp_path):
    """Tensor parallel 2: each rank's extra peak for the expert-heavy file is about half of one
    rank's (its experts, heads and vocabulary rows; the replicated parts are a few MiB here)."""
    from ds4_vllm.model.tiny_gguf import tiny_gguf_file

    baseline = tiny_gguf_file("ds4-tiny-q2")
    (one_big,), _ = worker_peaks(expert_heavy_gguf, tmp_path)
    (one_base,), _ = worker_peaks(baseline, tmp_path)
    two_big, _ = worker_peaks(expert_heavy_gguf, tmp_path, tp=2)
    two_base, _ = worker_peaks(baseline, tmp_path, tp=2)
    one_rank = one_big - one_base
    per_rank = [(big - base) / one_rank for big, base in zip(sorted(two_big), sorted(two_base), strict=True)]
    print(
        f"extra peak for the expert-heavy file: 1 rank {one_rank / 2**20:.0f} MiB; 2 ranks "
        + ", ".join(
            f"{(b - a) / 2**20:.0f} MiB" for b, a in zip(sorted(two_big), sorted(two_base), strict=True)
        )
        + f" = {', '.join(f'{r:.2f}' for r in per_rank)} of one rank's"
    )
    assert all(r <= PER_RANK_LIMIT for r in per_rank), per_rank
