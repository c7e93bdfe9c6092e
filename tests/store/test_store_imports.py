"""The store must stay importable without torch or vLLM (it runs in the scheduler and the CLI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CODE = """
import sys
import ds4_vllm.store, ds4_vllm.store.options, ds4_vllm.store.policy, ds4_vllm.store.fs
import ds4_vllm.store.checkpoint_store, ds4_vllm.store.trace, ds4_vllm.store.stats
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers'))
print(','.join(heavy))
"""


def test_no_torch_or_vllm_imported() -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, cwd=root, timeout=60, check=True
    )
    assert proc.stdout.strip() == "", f"heavy modules imported: {proc.stdout.strip()}"
