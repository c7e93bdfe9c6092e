"""One `ServingState` per API server: built once from the config, reached by every component
through the handle vLLM gives it (the app's engine client, the wrapped engine client, the
renderer's tokenizer). No engine is started: the config is the part of `VllmConfig` it reads."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from types import SimpleNamespace

from ds4_vllm.chat.tokenizer import default_tokenizer
from ds4_vllm.contracts import TOOL_IDS_KEY, TOOL_MAP_KEY
from ds4_vllm.serving.request_outputs import record_outputs
from ds4_vllm.serving.state import (
    ServingState,
    register_for_tokenizer,
    serving_state_for_tokenizer,
    serving_state_of_app,
    serving_state_of_engine,
)
from ds4_vllm.store.trailers import read_tool_map
from tests.shared_data import ENGINE_TESTDATA, require

ENGINE_FILES = ENGINE_TESTDATA / "q2"


def config(kv_transfer_config=None) -> SimpleNamespace:
    """The fields of vLLM's `VllmConfig` the state reads (a hub id: no model files are read)."""
    return SimpleNamespace(
        kv_transfer_config=kv_transfer_config,
        model_config=SimpleNamespace(model="deepseek-ai/DeepSeek-V4-Flash", revision=None),
    )


def ds4disk(directory: Path, **extra) -> SimpleNamespace:
    return SimpleNamespace(
        kv_connector="ds4disk", kv_connector_extra_config={"kv_disk_dir": str(directory), **extra}
    )


def test_with_ds4disk_every_part_reads_the_directory(tmp_path: Path) -> None:
    require(ENGINE_FILES, "the ds4 engine's q2 files")
    files = sorted(ENGINE_FILES.glob("*.kv"))
    for f in files:
        shutil.copy(f, tmp_path / f.name)
    trailers = {tool_id: block for f in files for tool_id, block in read_tool_map(f)}
    assert trailers, "the engine files hold KTM trailers"

    state = ServingState.from_config(config(ds4disk(tmp_path, tool_memory_max_ids=1234)), default_tokenizer())

    assert (state.tool_memory.max_ids, len(state.tool_memory)) == (1234, len(trailers))
    assert {tool_id: state.replay(tool_id) for tool_id in trailers} == trailers
    assert state.text_reuse is not None and state.text_reuse.files is not None
    assert (state.counters.persistent, state.counters.directory) == (True, tmp_path)
    report = state.kv_cache_report()
    assert (report["disk_cache"], report["directory"], report["entries"]) == (True, str(tmp_path), len(files))
    request = SimpleNamespace(messages=[], kv_transfer_params=None)
    state.attach_tool_transfer_params(request)
    assert set(request.kv_transfer_params) == {TOOL_IDS_KEY, TOOL_MAP_KEY}  # for the connector


def test_without_ds4disk_everything_is_this_process_only() -> None:
    state = ServingState.from_config(config(), default_tokenizer())
    assert (state.disk, state.counters.persistent, state.tool_memory.checkpoints) == (None, False, None)
    assert state.text_reuse is not None and state.text_reuse.files is None
    assert ServingState.from_config(config(), None).text_reuse is None  # vLLM without a tokenizer
    # No connector reads kv_transfer_params, and vLLM warns about every request that has them.
    request = SimpleNamespace(messages=[], kv_transfer_params=None)
    state.attach_tool_transfer_params(request)
    assert request.kv_transfer_params is None


def test_each_component_reaches_the_one_state() -> None:
    tokenizer = default_tokenizer()
    state = ServingState()
    engine_client = SimpleNamespace(renderer=SimpleNamespace(serving=state, tokenizer=tokenizer))
    register_for_tokenizer(tokenizer, state)  # what Ds4Renderer.__init__ does
    assert serving_state_of_app(SimpleNamespace(engine_client=engine_client)) is state
    assert serving_state_of_engine(engine_client) is state
    assert serving_state_for_tokenizer(tokenizer) is state
    # another model's renderer has no ds4 state; the app has none then
    assert serving_state_of_app(SimpleNamespace(engine_client=SimpleNamespace(renderer=object()))) is None
    assert serving_state_of_app(SimpleNamespace()) is None


def test_the_generate_hook_feeds_the_wrapped_engine_clients_text_reuse() -> None:
    remembered: list[list[int]] = []
    state = ServingState(text_reuse=SimpleNamespace(remember=remembered.append))
    engine_client = SimpleNamespace(renderer=SimpleNamespace(serving=state))

    async def generate(engine, prompt_ids, sampling_params):
        completion = SimpleNamespace(index=0, token_ids=[7, 8], finish_reason=None)
        yield SimpleNamespace(outputs=[completion], finished=False, prompt_token_ids=prompt_ids)
        completion = SimpleNamespace(index=0, token_ids=[7, 8, 9], finish_reason="stop")
        yield SimpleNamespace(outputs=[completion], finished=True, prompt_token_ids=prompt_ids)

    async def run() -> None:
        hooked = record_outputs(generate)
        params = SimpleNamespace(output_kind=SimpleNamespace(name="CUMULATIVE"))
        async for _ in hooked(engine_client, [1, 2, 3], params):
            pass

    asyncio.run(run())
    assert remembered == [[1, 2, 3, 7, 8, 9]]
