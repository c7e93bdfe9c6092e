"""Issue 11: the arithmetic cost model's values, and the prefill-scaling benchmark's quick path.

The FLOP counts are checked against a config small enough to count by hand (the sums are in the
comments); the benchmark run checks what it writes, never how long anything took.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.arithmetic import flops_by_component, prefill_flops, prefill_flops_by_component, token_flops

# One ratio-4 layer. Per token (FLOP = 2 x multiply-adds):
#   projections 784 = q_a 2*4*4=32 + q_b 2*4*(2*8)=128 + kv 2*4*8=64 + o_a 2*(2*8)*2=64 + o_b 2*(2*2)*4=32
#     + compressor kv+gate 2*(2*4*(2*8))=256 + indexer compressor 2*(2*4*(2*4))=128
#     + indexer q_b 2*4*(2*4)=64 + head weights 2*4*2=16
#   MoE 248 = router 2*4*4=32 + (2 routed + 1 shared) * 3 * 2*4*3=216
#   hyper-connections 432 = 2 sub-layers * (mixes 2*(2*4)*(4*2)=128 + collapse 16 + comb 2*2*2*4=32
#     + post 16) + head (2*(2*4)*2=32 + 16)
#   window: 4*2*8=64 per raw row (min(p+1, 4) rows); indexer: 2*2*4 + 2*2 = 20 per visible
#   compressed row ((p+1)//4 rows); ratio-4 attention: 64 per picked row (min(rows, topk=1))
#   LM head 2*4*10 = 80 per logits row.
SMALL = SimpleNamespace(
    hidden_size=4,
    num_attention_heads=2,
    head_dim=8,
    q_lora_rank=4,
    o_groups=2,
    o_lora_rank=2,
    sliding_window=4,
    index_n_heads=2,
    index_head_dim=4,
    index_topk=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=3,
    n_shared_experts=1,
    hc_mult=2,
    vocab_size=10,
    compress_ratios=[4],
)


def test_flops_per_token_by_position_match_the_hand_count():
    parts = flops_by_component(SMALL, [0, 3, 7])
    assert parts["projections"].tolist() == [784, 784, 784]
    assert parts["window_attention"].tolist() == [64, 256, 256]
    assert parts["indexer"].tolist() == [0, 20, 40]
    assert parts["ratio4_attention"].tolist() == [0, 64, 64]
    assert parts["ratio128_attention"].tolist() == [0, 0, 0]
    assert parts["moe"].tolist() == [248, 248, 248]
    assert parts["hyper_connections"].tolist() == [432, 432, 432]
    # Decode at position 7: 784 + 256 + 40 + 64 + 248 + 432 + LM head 80.
    assert token_flops(SMALL, 7) == 1904


def test_prefill_flops_sum_positions_and_count_one_lm_head_per_chunk():
    # 8 tokens: window rows 1+2+3+4*5=26, indexer rows 0+0+0+1+1+1+1+2=6, picked rows 5,
    # 1464 per token otherwise, and 2 chunks of 4 tokens -> 2 LM head rows.
    parts = prefill_flops_by_component(SMALL, 8, chunk=4)
    assert parts["window_attention"] == 26 * 64
    assert parts["indexer"] == 6 * 20
    assert parts["ratio4_attention"] == 5 * 64
    assert parts["lm_head"] == 2 * 80
    assert prefill_flops(SMALL, 8, chunk=4) == 1664 + 120 + 320 + 8 * 1464 + 160
    assert prefill_flops(SMALL, 8) == prefill_flops(SMALL, 8, chunk=4) - 80
    with pytest.raises(ValueError, match="chunk"):
        prefill_flops(SMALL, 8, chunk=0)


def test_ratio_128_layer_attends_to_every_compressed_row():
    config = SimpleNamespace(**{**vars(SMALL), "compress_ratios": [128]})
    parts = flops_by_component(config, [126, 127, 255])
    assert parts["ratio128_attention"].tolist() == [0, 64, 128]
    assert parts["indexer"].tolist() == [0, 0, 0]


def test_quick_path_writes_figures_and_plot(tmp_path):
    from benchmarks import model_scaling

    result = model_scaling.run(
        tmp_path, quick=True, lengths=[40, 150], repeats=1, engine=False, reference=False
    )
    written = json.loads((tmp_path / "model_scaling.json").read_text())
    assert written["prefill_scaling"]["ratios"].keys() == {"40->150"}
    ratio = written["prefill_scaling"]["ratios"]["40->150"]
    config = model_scaling.load_config("ds4")[0]
    assert ratio["predicted_flop_ratio"] == pytest.approx(
        prefill_flops(config, 150, model_scaling.CHUNK) / prefill_flops(config, 40, model_scaling.CHUNK)
    )
    assert ratio["measured_time_ratio"] > 0
    assert written["settings"]["lengths"] == [40, 150] and result["settings"] == written["settings"]
    assert (tmp_path / "model_scaling_prefill.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert written["plots"] == ["model_scaling_prefill.png"]
    measured, predicted = ratio["measured_time_ratio"], ratio["predicted_flop_ratio"]
    assert (
        f"| 40->150 | {measured:.3g} | {predicted:.3g} | {measured / predicted:.3g} |"
        in written["table_markdown"]
    )


def test_chunked_prefill_matches_one_step():
    """The benchmark's chunked prefill is the model's own: same last hidden state as one step."""
    import torch

    from benchmarks import model_scaling

    net, _ = model_scaling.build_direct_model("ds4")
    ids = torch.randint(1000, 100000, (300,), generator=torch.Generator().manual_seed(3))
    whole = model_scaling.chunked_prefill(net, ids, chunk=300)
    chunked = model_scaling.chunked_prefill(net, ids, chunk=64)
    # Chunking changes only the grouping of float32 matmuls: measured max |diff| 0 to 2e-6 here.
    assert torch.allclose(whole, chunked, atol=1e-4, rtol=0)
