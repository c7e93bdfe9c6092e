"""The store must stay importable without torch or vLLM (it runs in the scheduler and the CLI).

Every module of `ds4_vllm/store/` is imported, found by listing the package, so a new module is
checked without anyone adding it here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORE_MODULES = sorted(
    f"ds4_vllm.store.{p.stem}" for p in (ROOT / "ds4_vllm" / "store").glob("*.py") if p.stem != "__init__"
)
CODE = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers'))
print(','.join(heavy))
"""


def test_every_store_module_is_listed() -> None:
    assert {"ds4_vllm.store.text_reuse", "ds4_vllm.store.tool_memory", "ds4_vllm.store.policy"} <= set(
        STORE_MODULES
    )


def test_no_torch_or_vllm_imported() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CODE, "ds4_vllm.store", *STORE_MODULES],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    assert proc.stdout.strip() == "", f"heavy modules imported: {proc.stdout.strip()}"
