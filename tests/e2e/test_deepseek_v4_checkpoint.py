"""A transformers-saved DeepseekV4ForCausalLM checkpoint served by our model with one flag.

The directory is what a user gets from transformers: `from_pretrained` of the default model's
weights, `save_pretrained` (native-style names such as `head.weight`,
`model.layers.N.ffn.experts.E.w1.weight`, and transformers' config form), with the tokenizer files
copied in. Served with `--config-format ds4` and nothing else (no `--tokenizer`), through
`LLM(...)` and through a real `vllm serve` process (tokenizer, renderer and API server read the
directory too), its greedy output must equal the default model's.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.e2e.server_process import ServerProcess

# heavy: about 100 s (a checkpoint saved by transformers, an engine and a server); CI keeps the
# same directory's parity in tests/model/test_vs_transformers.py.
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams


def main():
    llm = LLM(max_model_len=1024, enforce_eager=True, dtype="float32", **json.loads(sys.argv[1]))
    outs = llm.generate(["The capital of France is", "1 2 3 4"],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    print("RESULT " + json.dumps([[list(o.outputs[0].token_ids), o.outputs[0].text] for o in outs]))


if __name__ == "__main__":  # vLLM spawns processes that re-import this file
    main()
"""


def _generate(kwargs: dict, env: dict, script: Path) -> list:
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
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, v4_dir / name)
    saved = json.loads((v4_dir / "config.json").read_text())
    assert saved["model_type"] == "deepseek_v4" and "hash_moe" in saved["mlp_layer_types"]

    script = tmp_path / "generate.py"
    expected = _generate({"model": "ds4"}, env, script)
    got = _generate({"model": str(v4_dir), "config_format": "ds4"}, env, script)
    assert got == expected

    server = ServerProcess(
        [str(v4_dir), "--config-format", "ds4", "--max-model-len", "1024", "--dtype", "float32"],
        tmp_path / "serve.log",
        env=env,
    ).start()
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        # Token prompts: /v1/completions wraps text prompts in the ds4 chat template (§8.2),
        # which offline `LLM.generate` does not; the engine's tokenizer gives the same ids.
        from ds4_vllm.chat.tokenizer import default_tokenizer

        texts = [
            client.completions.create(
                model=str(v4_dir),
                prompt=default_tokenizer().encode(prompt),
                max_tokens=8,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
            for prompt in ("The capital of France is", "1 2 3 4")
        ]
        chat = client.chat.completions.create(
            model=str(v4_dir), messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0.0
        )
    finally:
        server.stop()
    assert texts == [text for _, text in expected]
    assert chat.usage.prompt_tokens > 1 and chat.choices[0].message.content is not None
