"""ds4_vllm.chat must import without vLLM, torch or transformers, and only lean on kvc and contracts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

CODE = """
import sys
import ds4_vllm.chat.chat_request, ds4_vllm.chat.anthropic_request, ds4_vllm.chat.responses_request
import ds4_vllm.chat.completion_request, ds4_vllm.chat.tokenizer, ds4_vllm.chat.json_text
from ds4_vllm.chat.tokenizer import default_tokenizer
default_tokenizer().encode("x")
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers', 'tokenizers'))
layers = sorted({m.split('.')[1] for m in sys.modules if m.startswith('ds4_vllm.') and m.count('.') >= 1})
print(','.join(heavy) + '|' + ','.join(layers))
"""


def test_no_heavy_or_upper_layer_imports() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=True
    )
    heavy, layers = proc.stdout.strip().split("|")
    assert heavy == "", f"heavy modules imported: {heavy}"
    assert set(layers.split(",")) <= {"chat", "contracts", "kvc"}, layers
