"""Issue 11: the real-width slice generator (`benchmarks/slice_model.py`) and the lookup part of
`benchmarks/micro.py`, on reduced sizes so the whole file runs in a few seconds.

Nothing here asserts a time: the benchmark measures, these tests check that what it measures is
what it says (shapes, quant types, shared expert bytes, determinism, lookups that hit).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as GgmlType

from benchmarks import micro, micro_render, slice_model
from benchmarks.micro_results import EnginePhase, MicroResults, RestartResult
from ds4_vllm.kvc import ModelDims, checkpoint_file_size, payload_size
from ds4_vllm.model.gguf_file import Ds4GgufFile
from ds4_vllm.model.quant.dequant import dequantize

# Narrow widths, 8 experts, 2,048-token vocabulary (no embedded tokenizer): a 25 MB file.
REDUCED = dict(
    n_routed_experts=8,
    hidden_size=512,
    vocab_size=2048,
    num_attention_heads=8,
    q_lora_rank=256,
    o_groups=2,
    o_lora_rank=256,
    index_n_heads=8,
    moe_intermediate_size=512,
)


def reduced_config():
    return slice_model.slice_config(**REDUCED)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_slice_config_has_deepseek_v4_flash_widths():
    c = slice_model.slice_config()
    assert (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads) == (4096, 512, 64, 1)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank) == (1024, 8, 1024)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 512)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 6, 2048)
    assert (c.vocab_size, c.sliding_window, c.rope_dim, c.hc_mult) == (129280, 128, 64, 4)
    assert c.compress_ratios == [0, 0, 4, 128]
    assert list(c.mlp_layer_types) == ["hash_moe"] * 3 + ["moe"]
    assert c.rope_parameters["compress"]["rope_theta"] == 160000.0
    assert c.rope_parameters["compress"]["factor"] == 16.0
    assert c.max_position_embeddings == 1048576
    # The KVC payload dims the connector writes for it (header words 8-11).
    assert micro.dims_of(c) == ModelDims(n_layer=4, head_dim=512, index_dim=128, n_vocab=129280)


@pytest.fixture(scope="module")
def reduced_file(tmp_path_factory) -> Path:
    return slice_model.make_slice_model(tmp_path_factory.mktemp("slice"), config=reduced_config())


def test_reduced_slice_file_reads_back_with_its_config_and_ds4_q2_types(reduced_file):
    gguf_file = Ds4GgufFile.open(reduced_file)
    config = gguf_file.config()
    want = reduced_config()
    for field in (
        "hidden_size",
        "head_dim",
        "num_attention_heads",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "index_n_heads",
        "index_head_dim",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "vocab_size",
        "sliding_window",
        "max_position_embeddings",
    ):
        assert getattr(config, field) == getattr(want, field), field
    assert config.compress_ratios == [0, 0, 4, 128]
    assert list(config.mlp_layer_types) == ["hash_moe"] * 3 + ["moe"]
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(reduced_file).tensors}
    assert types["blk.3.ffn_gate_exps.weight"] == GgmlType.IQ2_XXS
    assert types["blk.3.ffn_up_exps.weight"] == GgmlType.IQ2_XXS
    assert types["blk.3.ffn_down_exps.weight"] == GgmlType.Q2_K
    assert types["blk.2.attn_q_b.weight"] == GgmlType.Q8_0
    assert types["output.weight"] == GgmlType.Q8_0
    assert types["token_embd.weight"] == GgmlType.F16
    assert types["blk.2.indexer.attn_q_b.weight"] == GgmlType.F16


def test_generated_codes_have_the_intended_scale(reduced_file):
    """Dequantized weights are zero-mean with std 1/sqrt(fan_in).

    Measured over seeds 1-3: std*sqrt(fan_in) in 0.9977-1.0041 and |mean/std| <= 0.0039 for
    routed gate/down, the Q8_0 head and wq_b; the bounds are 5x those deviations.
    """
    tensors = dict(Ds4GgufFile.open(reduced_file).tensors())
    for name in (
        "layers.0.ffn.experts.w1",
        "layers.0.ffn.experts.w2",
        "head.weight",
        "layers.2.attn.wq_b.weight",
    ):
        w = dequantize(tensors[name])
        assert abs(w.std().item() * w.shape[-1] ** 0.5 - 1.0) < 0.025, name
        assert abs(w.mean().item() / w.std().item()) < 0.02, name


def test_layers_share_one_routed_expert_stack_unless_asked(reduced_file, tmp_path):
    def expert_offsets(path: Path) -> dict[str, int]:
        return {
            t.name: int(t.data_offset)
            for t in gguf.GGUFReader(path).tensors
            if t.name.endswith(("gate_exps.weight", "up_exps.weight", "down_exps.weight"))
        }

    shared = expert_offsets(reduced_file)
    for kind in ("gate", "up", "down"):
        assert {shared[f"blk.{il}.ffn_{kind}_exps.weight"] for il in range(4)} == {
            shared[f"blk.0.ffn_{kind}_exps.weight"]
        }
    distinct_path = slice_model.make_slice_model(tmp_path, config=reduced_config(), expert_stacks=4)
    distinct = expert_offsets(distinct_path)
    assert len(set(distinct.values())) == 12
    # Three more stacks of 8 experts: gate+up IQ2_XXS (66 B per 256 values), down Q2_K (84 B).
    per_stack = 8 * 512 * 512 // 256 * (2 * 66 + 84)
    assert distinct_path.stat().st_size - reduced_file.stat().st_size == 3 * per_stack


def test_slice_file_is_made_once_and_is_deterministic(reduced_file, tmp_path):
    before = reduced_file.stat().st_mtime_ns
    again = slice_model.make_slice_model(reduced_file.parent, config=reduced_config())
    assert again == reduced_file and again.stat().st_mtime_ns == before
    elsewhere = slice_model.make_slice_model(tmp_path, config=reduced_config())
    assert elsewhere.name == reduced_file.name
    assert sha256(elsewhere) == sha256(reduced_file)
    other_seed = slice_model.make_slice_model(tmp_path, config=reduced_config(), seed=1)
    assert other_seed.name != reduced_file.name


def test_lookup_benchmark_hits_the_prefix_file_at_every_count(tmp_path):
    rows = micro.lookup_cost([10, 40], tmp_path, calls=3, prompt_tokens=1024)
    assert [r.entries for r in rows] == [10, 40]
    assert [len(list((tmp_path / f"lookup-{n}").glob("*.kv"))) for n in (10, 40)] == [10, 40]
    for row in rows:
        assert row.hit_tokens == 2 * 1024 // 3 // 64 * 64  # the prefix file, not another one
        assert row.median_ms > 0


def test_throughput_rows_measure_the_checkpoint_file_size(tmp_path):
    dims = ModelDims(n_layer=4, head_dim=64, index_dim=32, n_vocab=256)
    (row,) = micro.checkpoint_throughput("small", dims, [600], tmp_path, repeats=1)
    payload = micro.synthetic_payload(dims, 600, ctx_size=8192, seed=600)
    expected = checkpoint_file_size(600 * micro.TEXT_BYTES_PER_TOKEN, payload_size(payload.header))
    assert round(row.file_mib * 2**20) == expected
    assert not list((tmp_path / "small-600").iterdir())  # the scratch files are removed


def test_q4_recipe_writes_q4_k_experts_and_bad_recipes_are_named(tmp_path):
    path = slice_model.make_slice_model(tmp_path, config=reduced_config(), quant="q4")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert {types[f"blk.3.ffn_{k}_exps.weight"] for k in ("gate", "up", "down")} == {GgmlType.Q4_K}
    with pytest.raises(ValueError, match="quant must be one of"):
        slice_model.make_slice_model(tmp_path, config=reduced_config(), quant="q3")
    with pytest.raises(ValueError, match="expert_stacks must be >= 1"):
        slice_model.make_slice_model(tmp_path, config=reduced_config(), expert_stacks=0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left behind


@pytest.mark.parametrize("spec", ["slice:", "slice:x", "slice:-4", "slice:0", "slices", "ds4"])
def test_a_bad_slice_argument_is_named_before_any_file_is_made(spec, monkeypatch):
    monkeypatch.setattr(slice_model, "make_slice_model", lambda **_: pytest.fail("made a file"))
    with pytest.raises(ValueError, match='expected "slice" or "slice:N"'):
        slice_model.slice_for(spec)


def test_slice_argument_gives_its_expert_count_and_the_label(monkeypatch, tmp_path):
    monkeypatch.setattr(
        slice_model, "make_slice_model", lambda config: tmp_path / str(config.n_routed_experts)
    )
    config, path, label = slice_model.slice_for("slice:16")
    assert (config.n_routed_experts, config.hidden_size, path, label) == (
        16,
        4096,
        tmp_path / "16",
        "slice with 16 routed experts",
    )
    assert slice_model.slice_for("slice")[2] == "slice"


def restart_result(cold_s: float, restored_s: float, read_s: float, suffix_s: float) -> RestartResult:
    return RestartResult(
        model="ds4",
        prompt_tokens=2048,
        suffix_tokens=16,
        cold=EnginePhase(engine_start_s=20.0, prompt_tokens=2048, ttft_s=cold_s),
        restored=EnginePhase(
            engine_start_s=20.0, prompt_tokens=2064, ttft_s=restored_s, suffix_prefill_s=suffix_s
        ),
        files=[],
        restored_file_payload_header={},
        resident_before_restore=0.0,
        sequential_read_s=read_s,
    )


def test_the_restart_goal_needs_the_speed_up_and_the_read_plus_suffix_bound() -> None:
    assert restart_result(2.0, 0.05, 0.02, 0.02).met  # 40x, 1.25 of read + suffix
    assert not restart_result(2.0, 0.05, 0.01, 0.02).met  # 40x, but 1.67 of read + suffix
    assert not restart_result(0.9, 0.05, 0.02, 0.02).met  # 1.25 of read + suffix, but 18x
    results = MicroResults(
        quick=True, machine={}, page_cache={}, restart=restart_result(2.0, 0.05, 0.01, 0.02)
    )
    written = json.loads(json.dumps(results.to_json()))
    assert written["restart"]["speedup_vs_cold"] == 40.0
    assert written["restart"]["met"] is False
    assert "| 2 | 0.05 | 40 | 0.01 | 0.02 | 1.67 | no |" in micro_render.tables(results)
