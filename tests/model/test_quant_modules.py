"""QuantLinear / QuantExperts keep weights packed and compute what the float modules compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ds4_vllm.model.quant import QuantizedWeight, QuantType, modules, packed_shape, scale_shape
from ds4_vllm.model.quant.dequant import dequantize
from ds4_vllm.model.quant.modules import QuantExperts, QuantExpertWeight, QuantLinear, quant_linear


def q8_0(shape: tuple[int, ...], seed: int) -> QuantizedWeight:
    """Q8_0 bytes with small finite fp16 scales (|d| < 2^-3), so products stay in a sane range."""
    raw = np.random.default_rng(seed).integers(
        0, 256, size=packed_shape(QuantType.Q8_0, shape), dtype=np.uint8
    )
    raw.reshape(-1, 34)[:, 1] &= 0x2F
    return QuantizedWeight(QuantType.Q8_0, shape, torch.from_numpy(raw))


def mxfp4(shape: tuple[int, ...], seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, packed_shape(QuantType.MXFP4, shape), dtype=torch.uint8, generator=g)
    scale = torch.randint(118, 124, scale_shape(QuantType.MXFP4, shape), dtype=torch.uint8, generator=g)
    return QuantizedWeight(QuantType.MXFP4, shape, data, scale)


def test_quant_linear_keeps_bytes_packed_and_matches_float_linear() -> None:
    weight = q8_0((64, 128), seed=1)
    layer = QuantLinear(128, 64)
    layer.set_weight(weight)
    layer.to(torch.bfloat16)  # a model-wide dtype cast must not touch the packed bytes
    assert layer.weight is None and layer.weight_packed.dtype == torch.uint8
    assert layer.nbytes == 64 * 4 * 34
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer(x), F.linear(x, dequantize(weight)))
    assert torch.equal(layer(x.bfloat16()), F.linear(x.bfloat16(), dequantize(weight, dtype=torch.bfloat16)))


def fp8_block(shape: tuple[int, int], seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 126, shape, dtype=torch.uint8, generator=g)  # finite E4M3 codes
    scale = torch.randint(118, 124, scale_shape(QuantType.FP8_BLOCK, shape), dtype=torch.uint8, generator=g)
    return QuantizedWeight(QuantType.FP8_BLOCK, shape, data, scale)


@pytest.mark.parametrize("make", [q8_0, mxfp4, fp8_block], ids=["q8_0", "mxfp4", "fp8_block"])
@pytest.mark.parametrize("tokens", [(1,), (3, 2)], ids=["one-token", "batch-of-6"])
def test_few_tokens_apply_a_large_packed_weight_in_row_blocks(make, tokens, monkeypatch) -> None:
    """Decode: the weight is dequantized a row block at a time, never whole, with F.linear's values."""
    monkeypatch.setattr(modules, "ROW_BLOCK_BYTES", 64 * 256 * 4)  # 64 rows of 256 inputs a block
    weight = make((300, 256), seed=5)  # 4 blocks of 64 rows and one of 44
    bias = torch.randn(300, generator=torch.Generator().manual_seed(6))
    x = torch.randn(*tokens, 256, generator=torch.Generator().manual_seed(7))
    requested: list[int] = []

    def recording(w, index=None, dtype=torch.float32):
        requested.append(w.shape[0] if index is None else len(index))
        return dequantize(w, index=index, dtype=dtype)

    monkeypatch.setattr(modules, "dequantize", recording)
    got = quant_linear(x, weight, bias)
    assert requested == [64, 64, 64, 64, 44]
    full = dequantize(weight)
    expected = F.linear(x, full, bias)
    # Only the order of the 256-term sums may differ: the bound for float32 summation,
    # 256 * 2^-24 * (|x| @ |w|^T + |bias|), elementwise.
    bound = 256 * 2.0**-24 * (F.linear(x.abs(), full.abs()) + bias.abs())
    assert got.shape == expected.shape
    assert bool(((got - expected).abs() <= bound).all())


def test_a_prefill_chunk_uses_the_whole_weight_once(monkeypatch) -> None:
    monkeypatch.setattr(modules, "ROW_BLOCK_BYTES", 64 * 256 * 4)
    weight = q8_0((300, 256), seed=5)
    x = torch.randn(modules.ROW_BLOCK_MAX_TOKENS + 1, 256, generator=torch.Generator().manual_seed(7))
    assert torch.equal(quant_linear(x, weight), F.linear(x, dequantize(weight)))


def test_quant_linear_accepts_a_float_weight() -> None:
    layer = QuantLinear(4, 3)
    w = torch.arange(12, dtype=torch.float32).view(3, 4)
    layer.set_weight(w)
    assert torch.equal(layer(torch.ones(1, 4)), torch.tensor([[6.0, 22.0, 38.0]]))


def test_quant_linear_before_and_after_loading_errors() -> None:
    layer = QuantLinear(128, 64)
    layer.to("cpu")  # an unset layer moves without a weight to copy
    with pytest.raises(RuntimeError, match="QuantLinear: weight was never set"):
        layer(torch.zeros(1, 128))
    with pytest.raises(ValueError, match=r"Q8_0 weight has logical shape \(64, 96\), expected \(64, 128\)"):
        layer.set_weight(q8_0((64, 96), seed=0))
    with pytest.raises(ValueError, match=r"weight has shape \(128, 64\), expected \(64, 128\)"):
        layer.set_weight(torch.zeros(128, 64))
    with pytest.raises(TypeError, match="wrap packed bytes in a QuantizedWeight"):
        layer.set_weight(torch.zeros(64, 128, dtype=torch.uint8))


def test_expert_stack_loaded_one_expert_at_a_time() -> None:
    stack = QuantExpertWeight(4, 8, 64, "w1")
    experts = {e: mxfp4((8, 64), seed=e) for e in (2, 0, 3)}
    for e, w in experts.items():
        stack.set_expert(e, w)
    assert stack.missing_experts() == [1]
    assert stack.nbytes == 4 * (8 * 32 + 8 * 2)  # the packed size, not the float size
    got = stack.expert_weights([3, 0])
    assert torch.equal(got[0], dequantize(experts[3])) and torch.equal(got[1], dequantize(experts[0]))
    with pytest.raises(ValueError, match=r"w1: experts \[0, 2, 3\]... are MXFP4, this one is Q8_0"):
        stack.set_expert(1, q8_0((8, 64), seed=9))
    with pytest.raises(IndexError, match="w1: expert 4 is out of range for 4 experts"):
        stack.set_expert(4, experts[0])


def make_quant_experts(n_experts: int, hidden: int, ffn: int, budget: int) -> QuantExperts:
    module = QuantExperts(n_experts, hidden, ffn, limit=7.0, dequant_budget_bytes=budget)
    module.gate_proj.set_weight(q8_0((n_experts, ffn, hidden), seed=1))
    module.up_proj.set_weight(q8_0((n_experts, ffn, hidden), seed=2))
    module.down_proj.set_weight(q8_0((n_experts, hidden, ffn), seed=3))
    return module


def routing(tokens: int, n_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(tokens)])
    return indices, torch.rand(tokens, top_k, generator=g)


def _experts_by_token(x, indices, weights, gate, up, down, limit):
    """The routed-expert sum written out token by token and slot by slot, in float64."""
    x, gate, up, down = (t.double() for t in (x, gate, up, down))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, e in enumerate(indices[t].tolist()):
            g = (gate[e] @ x[t]).clamp(max=limit)
            u = (up[e] @ x[t]).clamp(min=-limit, max=limit)
            out[t] += float(weights[t, slot]) * (down[e] @ (torch.nn.functional.silu(g) * u))
    return out


def test_quant_experts_compute_the_routed_expert_sum() -> None:
    n_experts, hidden, ffn = 6, 64, 96
    quant = make_quant_experts(n_experts, hidden, ffn, budget=1)  # one expert per dequant group
    gate, up, down = (
        p.expert_weights(range(n_experts)) for p in (quant.gate_proj, quant.up_proj, quant.down_proj)
    )
    x = torch.randn(11, hidden, generator=torch.Generator().manual_seed(4))
    indices, weights = routing(11, n_experts, 3, seed=5)
    expected = _experts_by_token(x, indices, weights, gate, up, down, 7.0)
    got = quant(x, indices, weights)
    # float32 against a float64 reference: measured max |diff| 7e-4 on outputs up to 2.9e3
    # (2.4e-7 relative, float32 round-off); 1e-6 of the largest output leaves 4x headroom.
    assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max()
    whole_batch = make_quant_experts(n_experts, hidden, ffn, budget=1 << 30)
    assert torch.equal(whole_batch(x, indices, weights), got)


def test_quant_experts_dequantize_only_the_selected_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds4_vllm.model.quant import modules

    dequantized: list[list[int]] = []

    def recording_dequantize(weight: QuantizedWeight, index=None, dtype=torch.float32, **kw) -> torch.Tensor:
        dequantized.append(torch.as_tensor(index).tolist())
        return dequantize(weight, index=index, dtype=dtype, **kw)

    monkeypatch.setattr(modules, "dequantize", recording_dequantize)
    quant = make_quant_experts(8, 64, 64, budget=2 * 3 * 64 * 64 * 4)  # two experts per group
    indices = torch.tensor([[5, 2], [2, 7], [5, 7], [0, 2]])
    quant(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)), indices, torch.ones(4, 2))
    # gate, up, down for each group of the used experts 0, 2, 5, 7 in ascending order
    assert dequantized == [[0, 2]] * 3 + [[5, 7]] * 3


def test_experts_larger_than_the_budget_are_dequantized_a_projection_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real-width expert is 96 MiB in float32: its three projections are never float at once."""
    from ds4_vllm.model.quant import modules

    shapes: list[tuple[int, ...]] = []

    def recording_dequantize(weight: QuantizedWeight, index=None, dtype=torch.float32, **kw) -> torch.Tensor:
        out = dequantize(weight, index=index, dtype=dtype, **kw)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(modules, "dequantize", recording_dequantize)
    quant = make_quant_experts(8, 64, 96, budget=1)
    indices = torch.tensor([[5, 2], [2, 7]])
    quant(torch.randn(2, 64, generator=torch.Generator().manual_seed(0)), indices, torch.ones(2, 2))
    assert shapes == [(96, 64), (96, 64), (64, 96)] * 3  # gate, up, down of experts 2, 5, 7


@pytest.mark.parametrize("packed", [True, False])
def test_quant_experts_one_token_path_matches_the_general_path_bit_for_bit(packed: bool) -> None:
    """A decode step (one token) skips the batch bookkeeping; it must add the same floats in the same order."""
    n_experts, hidden, ffn = 8, 64, 96
    quant = make_quant_experts(n_experts, hidden, ffn, budget=2 * 3 * hidden * ffn * 4)
    if not packed:  # float weights are indexed in place instead of dequantized
        floats = QuantExperts(n_experts, hidden, ffn, limit=7.0)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(floats, name).set_weight(getattr(quant, name).expert_weights(range(n_experts)))
        quant = floats
    x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(6))
    indices, weights = routing(9, n_experts, 6, seed=7)
    indices[8] = torch.tensor([3, 1, 3, 0, 5, 6])  # an expert listed twice takes the general path
    fast = [quant(x[t : t + 1], indices[t : t + 1], weights[t : t + 1]) for t in range(9)]
    taken = [quant._forward_one_token(x[t : t + 1], indices[t], weights[t]) is not None for t in range(9)]
    assert taken == [True] * 8 + [False]
    quant._forward_one_token = lambda *args: None  # force the general path
    general = [quant(x[t : t + 1], indices[t : t + 1], weights[t : t + 1]) for t in range(9)]
    for t in range(9):
        assert torch.equal(fast[t], general[t]), f"token {t}"


@pytest.mark.parametrize("packed", [True, False])
def test_the_gathered_decode_path_computes_the_routed_expert_sum(packed: bool) -> None:
    """Off the CPU a decode batch gathers each (token, expert) pair's weights on the device
    (issue 25: no routing read back). It is plain torch, so it runs here too."""
    n_experts, hidden, ffn = 8, 64, 96
    quant = make_quant_experts(n_experts, hidden, ffn, budget=1 << 30)
    gate, up, down = (
        p.expert_weights(range(n_experts)) for p in (quant.gate_proj, quant.up_proj, quant.down_proj)
    )
    if not packed:
        quant = QuantExperts(n_experts, hidden, ffn, limit=7.0)
        for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            getattr(quant, name).set_weight(w)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(8))
    indices, weights = routing(5, n_experts, 6, seed=9)
    expected = _experts_by_token(x, indices, weights, gate, up, down, 7.0)
    got = quant._forward_gathered(x, indices, weights)
    # the same float32 round-off bound as the general path's (test above)
    assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_the_gathered_path_adds_only_this_ranks_experts() -> None:
    """Under expert parallelism a rank holds experts 4..7; routes to others add nothing here."""
    n_experts, hidden, ffn = 8, 64, 96
    full = make_quant_experts(n_experts, hidden, ffn, budget=1 << 30)
    gate, up, down = (
        p.expert_weights(range(n_experts)) for p in (full.gate_proj, full.up_proj, full.down_proj)
    )
    rank = QuantExperts(n_experts, hidden, ffn, limit=7.0, experts=range(4, 8))
    for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        getattr(rank, name).set_weight(w)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(10))
    indices, weights = routing(3, n_experts, 6, seed=11)
    mine = weights * (indices >= 4)
    expected = _experts_by_token(x, indices, mine, gate, up, down, 7.0)
    got = rank._forward_gathered(x, indices, weights)
    assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_one_token_dequantizes_only_its_experts_a_matrix_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes: list[tuple[int, ...]] = []

    def recording_dequantize(weight: QuantizedWeight, index=None, dtype=torch.float32, **kw) -> torch.Tensor:
        assert index is None
        shapes.append(weight.shape)
        return dequantize(weight, index=index, dtype=dtype, **kw)

    quant = make_quant_experts(8, 64, 96, budget=1 << 30)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    indices, weights = torch.tensor([[5, 2]]), torch.tensor([[0.25, 0.75]])
    monkeypatch.setattr(modules, "dequantize", recording_dequantize)
    quant(x, indices, weights)
    # experts 2 then 5, each gate, up, down: one [out, in] matrix per call, never the stack
    assert shapes == [(96, 64), (96, 64), (64, 96)] * 2


@pytest.mark.parametrize("make", [None, q8_0, mxfp4], ids=["float", "q8_0", "mxfp4"])
def test_weights_go_to_the_device_the_module_was_built_on(make) -> None:
    """Issue 25: vLLM builds the model under its target device and loads CPU tensors; the
    holders kept the CPU tensor, so on CUDA the first projection failed. The meta device stands
    in for CUDA here: built under it, every weight set from a CPU tensor ends up on it."""
    with torch.device("meta"):
        layer = QuantLinear(128, 64)
        stack = QuantExpertWeight(3, 64, 128)
    one = torch.randn(64, 128) if make is None else make((64, 128), seed=3)
    layer.set_weight(one)
    stack.set_expert(1, one)
    for holder in (layer, stack):
        stored = holder.stored_weight()
        tensors = [stored] if isinstance(stored, torch.Tensor) else [stored.data, stored.scale]
        assert {t.device.type for t in tensors if t is not None} == {"meta"}, holder.name
    assert QuantLinear(8, 4).to("meta").device.type == "meta"  # the device follows `.to()`
