"""kvc and store.eviction must stay importable on machines without torch or vLLM."""

from __future__ import annotations

import subprocess
import sys

from tests.kvc.kvc_helpers import REPO_ROOT

CODE = """
import sys
import ds4_vllm.kvc, ds4_vllm.kvc.index, ds4_vllm.store.eviction, ds4_vllm.cli.kv
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers'))
print(','.join(heavy))
"""


def test_no_torch_or_vllm_imported() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, check=True
    )
    assert proc.stdout.strip() == "", f"heavy modules imported: {proc.stdout.strip()}"
