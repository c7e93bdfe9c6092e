"""Issue 25: the model core imports and runs without vLLM (the GPU machine has none).

A child process where every `vllm` import fails builds the tiny default model with `Ds4CausalLM`,
loads its weights and prefills a prompt over paged states it binds itself; its logits equal the
same run in this process, where vLLM is importable.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.kvc.kvc_helpers import REPO_ROOT

PROMPT = [0, 17, 4242, 99, 1000, 7, 7, 7, 31337, 12, 5, 640, 2] * 5

RUN = f"""
import json, sys

class NoVllm:
    def find_spec(self, name, path, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vLLM is not installed here: " + name)

sys.meta_path.insert(0, NoVllm())
import torch
from ds4_vllm.model.default_model import default_config
from tests.model.direct_model import build_model, prefill_hidden

model = build_model(default_config())
hidden = prefill_hidden(model, torch.tensor({PROMPT}))
logits = model.compute_logits(hidden[-1:])[0]
print(json.dumps({{"vllm_loaded": any(m.split(".")[0] == "vllm" for m in sys.modules),
                  "logits": logits.tolist()}}))
"""


def test_the_model_core_runs_where_vllm_cannot_be_imported() -> None:
    from ds4_vllm.model.default_model import default_config
    from tests.model.direct_model import build_model, prefill_hidden

    child = subprocess.run(
        [sys.executable, "-c", RUN], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["vllm_loaded"] is False
    model = build_model(default_config())
    here = model.compute_logits(prefill_hidden(model, torch.tensor(PROMPT))[-1:])[0]
    assert torch.equal(torch.tensor(result["logits"]), here)
