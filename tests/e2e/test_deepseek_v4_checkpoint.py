"""A transformers-saved DeepseekV4ForCausalLM checkpoint served by our model with one flag.

Runs two real engines (in subprocesses): the default model `ds4`, and the same weights re-saved
by transformers (`model_type: deepseek_v4`) loaded with `config_format="ds4"` (`--config-format
ds4`). Greedy outputs must be identical.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams


def main():
    llm = LLM(max_model_len=1024, enforce_eager=True, dtype="float32", **json.loads(sys.argv[1]))
    outs = llm.generate(["The capital of France is", "1 2 3 4"],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))


if __name__ == "__main__":  # vLLM spawns processes that re-import this file
    main()
"""


def _generate(kwargs: dict, env: dict, script: Path) -> list[list[int]]:
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(kwargs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_deepseek_v4_dir_matches_default_model(tmp_path: Path) -> None:
    from transformers import DeepseekV4ForCausalLM

    from ds4_vllm.model.config import Ds4Config, to_transformers_config

    env = {
        **os.environ,
        "DS4_VLLM_CACHE": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    os.environ["DS4_VLLM_CACHE"] = env["DS4_VLLM_CACHE"]
    try:
        from ds4_vllm.model.default_model import default_model_dir

        model_dir = default_model_dir()
    finally:
        del os.environ["DS4_VLLM_CACHE"]
    v4_dir = tmp_path / "v4"
    model = DeepseekV4ForCausalLM.from_pretrained(
        model_dir, config=to_transformers_config(Ds4Config.from_pretrained(model_dir))
    )
    model.save_pretrained(v4_dir)
    del model

    script = tmp_path / "generate.py"
    expected = _generate({"model": "ds4"}, env, script)
    got = _generate(
        {
            "model": str(v4_dir),
            "tokenizer": str(model_dir),
            "config_format": "ds4",
        },
        env,
        script,
    )
    assert got == expected
