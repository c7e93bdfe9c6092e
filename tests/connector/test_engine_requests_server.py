"""Issue 20, must show: the ds4 engine's recorded requests R1 and R2, sent as recorded (their
bytes, `"model": "deepseek-v4-flash"`, `"seed": 3`), to `ds4-vllm serve` on the tiny q2 GGUF the
engine ran, with the engine's own q2 checkpoint files in `--kv-disk-dir`.

The engine's run (manifest "runs"): R1 prompt 2,942 tokens; R2 continues R1's tool call,
effective prompt 4,687. Its files hold R1's cold prefix (82df…, 2,048 tokens) and R2's
`continued` point (2b43…, 4,096 tokens). Our server must count the same prompts, read R1's
prefix from the engine's cold file, and reach R2's 4,096 (vLLM's memory holds what R1 left, the
rest comes from disk). R2 replays R1's tool call from the tool ids in the engine's KTM trailers.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from ds4_vllm.kvc import open_checkpoint
from tests.e2e.server_process import ServerProcess
from tests.shared_data import ENGINE_TESTDATA, make_engine_ggufs, require

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

#: The engine's q2 run used -c 16384.
CTX = 16384
#: R1's recorded answer: "usage prompt 2942"; R2's: "effective prompt 4687".
ENGINE_PROMPTS = {"R1": 2942, "R2": 4687}
#: The engine file each request starts from.
ENGINE_FILE = {
    "R1": "82df7b9500d936329aeb83e12ca870c126d1d756.kv",
    "R2": "2b43d1f7f98c90d5bae42da6047821c00bd0a972.kv",
}


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict:
    require(ENGINE_TESTDATA / "manifest.json", "the ds4 engine's test files")
    manifest = json.loads((ENGINE_TESTDATA / "manifest.json").read_text())
    gguf = make_engine_ggufs(tmp_path_factory.mktemp("gguf"))["q2"]
    disk = tmp_path_factory.mktemp("kv")
    for f in (ENGINE_TESTDATA / "q2").glob("*.kv"):
        shutil.copy(f, disk / f.name)
    log = tmp_path_factory.mktemp("log") / "serve.log"
    args = [str(gguf), "--kv-disk-dir", str(disk), "--max-model-len", str(CTX)]
    args += ["--kv-cache-memory-bytes", str(2 << 30)]
    server = ServerProcess(args, log).start(timeout=600)
    out = {}
    try:
        for name in ("R1", "R2"):
            body = manifest["requests"][name]["body"].encode()
            response = httpx.post(
                f"{server.base_url}/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=600,
            )
            out[name] = (response.status_code, response.json())
    finally:
        server.stop()
    out["log"] = log.read_text(errors="replace")
    return out


@pytest.mark.parametrize("name", ["R1", "R2"])
def test_the_engines_request_is_answered_with_its_prompt_count(answers, name: str) -> None:
    status, body = answers[name]
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == ENGINE_PROMPTS[name]
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_r1_reads_the_engines_cold_file_and_r2_reaches_its_continued_point(answers) -> None:
    tokens = {n: open_checkpoint(ENGINE_TESTDATA / "q2" / f).header.tokens for n, f in ENGINE_FILE.items()}
    assert tokens == {"R1": 2048, "R2": 4096}
    r1, r2 = answers["R1"][1]["usage"], answers["R2"][1]["usage"]
    assert r1["prompt_cache_hit_tokens"] == r1["prompt_cache_disk_tokens"] == tokens["R1"]
    assert r2["prompt_cache_hit_tokens"] == tokens["R2"]
    assert r2["prompt_cache_disk_tokens"] > 0  # the part beyond what R1 left in vLLM's memory
    assert "tool memory: 10 tool-call ids loaded" in answers["log"]  # R1's id among them
