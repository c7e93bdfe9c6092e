"""The fused dequantize-and-multiply kernels (`quant.fused`) against dequantize-then-matmul.

Weights are random blocks over each format's whole range (`quant_weights.random_gguf_weight`)
at the shapes the tiny models and the real-width slice use. The kernels sum a block's integer
codes before applying its scale, so they differ from the reference in float32 summation order
only: the error is bounded relative to the sum of |x_k * w_k| terms.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.nn.functional as F

from ds4_vllm.model.quant import QuantizedWeight, QuantType, fused
from ds4_vllm.model.quant.dequant import dequantize
from tests.model.quant_weights import random_gguf_weight

#: |kernel - reference| / sum_k |x_k w_k|, measured over 24 weights per format (these shapes and
#: [2048, 4096], 1 and 3 rows, 3 seeds): at most 2.4e-7 (Q8_0), 2.8e-7 (Q2_K), 4.4e-7 (IQ2_XXS),
#: 0.8e-7 (F16), 0.9e-7 (BF16);
#: float32 epsilon is 1.2e-7 and both sides round sums of up to 4,096 products in other orders.
RELATIVE_BOUND = 2e-6


@pytest.fixture(autouse=True)
def compile_on():
    """tests/conftest.py turns torch.compile off for test engines; these tests compile kernels."""
    with torch._dynamo.config.patch(disable=False):
        yield


def random_weight(qtype: QuantType, shape: tuple[int, ...], seed: int) -> QuantizedWeight:
    """Random blocks over a GGUF format's range; normal values stored as bytes for F16 / BF16."""
    if qtype.is_gguf_block:
        return random_gguf_weight(qtype, shape, seed)
    dtype = {QuantType.F16: torch.float16, QuantType.BF16: torch.bfloat16}[qtype]
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return QuantizedWeight(qtype, shape, values.view(torch.uint8))


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return RELATIVE_BOUND * F.linear(x.abs(), w.abs()) + 1e-30


NATIVE_TYPES = sorted(fused.NATIVE_TYPES, key=lambda q: q.value)
#: The Inductor expressions run only where the C++ loop cannot be built; each compiles for
#: seconds, so CI checks IQ2_XXS (the most involved) and the heavy run every format.
INDUCTOR_TYPES = [
    q if q is QuantType.IQ2_XXS else pytest.param(q, marks=pytest.mark.heavy)
    for q in sorted(fused.INDUCTOR_TYPES, key=lambda q: q.value)
]


@pytest.mark.parametrize("qtype", INDUCTOR_TYPES)
@pytest.mark.parametrize("shape", [(256, 256), (512, 1024)])
@pytest.mark.parametrize("rows", [1, 3])
def test_inductor_linear_kernel_matches_dequantize_then_matmul(qtype: QuantType, shape, rows: int) -> None:
    w = random_weight(qtype, shape, seed=rows + shape[0])
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(7))
    reference_w = dequantize(w)
    out = fused.linear_kernel(qtype)(x, w.data)
    assert out.shape == (rows, shape[0])
    assert ((out - F.linear(x, reference_w)).abs() <= _bound(x, reference_w)).all()


@pytest.mark.parametrize("qtype", INDUCTOR_TYPES)
def test_inductor_pairs_kernel_reads_each_pairs_expert(qtype: QuantType) -> None:
    stack = random_weight(qtype, (8, 256, 512), seed=3)
    ids = torch.tensor([5, 0, 5, 7, 2, 1])
    x = torch.randn(len(ids), 512, generator=torch.Generator().manual_seed(1))
    out = fused.pairs_kernel(qtype)(x, stack.data, ids)
    for p, e in enumerate(ids.tolist()):
        w = dequantize(stack, index=e)
        assert ((out[p] - w @ x[p]).abs() <= _bound(x[p : p + 1], w)[0]).all(), (p, e)


#: Segments covering the C++ loop's cases: one row (a format's dot loop), two, a row tile and its
#: remainder (five), an empty segment, and a matrix picked twice; 200 output rows leave partial
#: tiles of weight rows.
SEGMENT_MATRICES = [3, 0, 5, 1, 3]
SEGMENT_ROWS = [1, 2, 5, 0, 9]


def _check_segments(segments: fused.SegmentsKernel, qtype: QuantType, seed: int) -> None:
    stack = random_weight(qtype, (6, 200, 512), seed=seed)
    starts = torch.tensor([0, *SEGMENT_ROWS]).cumsum(0)
    x = torch.randn(int(starts[-1]), 512, generator=torch.Generator().manual_seed(seed))
    out = segments(x, stack.data, torch.tensor(SEGMENT_MATRICES), starts)
    assert out.shape == (x.shape[0], 200)
    for s, e in enumerate(SEGMENT_MATRICES):
        rows = x[starts[s] : starts[s + 1]]
        w = dequantize(stack, index=e)
        assert ((out[starts[s] : starts[s + 1]] - F.linear(rows, w)).abs() <= _bound(rows, w)).all(), (s, e)


@pytest.mark.parametrize("qtype", NATIVE_TYPES)
def test_native_segments_match_dequantize_then_matmul(qtype: QuantType) -> None:
    """The C++ loop, where it builds (this machine: asserted, so a broken build shows)."""
    assert fused.native_extension() is not None
    kernels = fused.kernels_for(qtype)
    assert kernels is not None and kernels.max_rows == fused.NATIVE_MAX_ROWS
    _check_segments(kernels.segments, qtype, seed=9)


@pytest.mark.parametrize("qtype", INDUCTOR_TYPES)
def test_inductor_fallback_segments_match(qtype: QuantType) -> None:
    """Where the C++ loop cannot be built, segments run through the Inductor kernels."""
    segments = fused._inductor_segments(fused.linear_kernel(qtype), fused.pairs_kernel(qtype))
    _check_segments(segments, qtype, seed=10)


def test_native_segments_reject_bad_arguments() -> None:
    kernels = fused.kernels_for(QuantType.Q8_0)
    stack = random_weight(QuantType.Q8_0, (2, 64, 64), seed=1)
    x = torch.zeros(3, 64)
    with pytest.raises(RuntimeError, match="matrix 2 is out of range for 2"):
        kernels.segments(x, stack.data, torch.tensor([2]), torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="starts must run from 0 to x's rows"):
        kernels.segments(x, stack.data, torch.tensor([0]), torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="x and data disagree on K"):
        kernels.segments(torch.zeros(3, 32), stack.data, torch.tensor([0]), torch.tensor([0, 3]))


@pytest.mark.heavy
@pytest.mark.parametrize("qtype", NATIVE_TYPES)
def test_the_avx2_variant_of_the_native_kernels(qtype: QuantType) -> None:
    """Machines without AVX-512 build packed_cpu.cpp's eight-lane loops: built here too."""
    avx2 = avx2_extension()
    _check_segments(fused._native_segments(qtype, avx2), qtype, seed=11)


@cache
def avx2_extension():
    return fused.build_native_extension("ds4_vllm_packed_cpu_avx2", ["-O3", "-march=native", "-mno-avx512f"])


def test_grouped_projection_takes_group_j_through_row_block_j() -> None:
    w = random_gguf_weight(QuantType.Q8_0, (2 * 64, 128), seed=11)
    x = torch.randn(3, 2, 128, generator=torch.Generator().manual_seed(2))
    kernels = fused.kernels_for(QuantType.Q8_0)
    out = kernels.project(x, w.data, groups=2)
    expected = torch.einsum("tgi,goi->tgo", x, dequantize(w).view(2, 64, 128))
    assert out.shape == (3, 2, 64)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-3 * expected.abs().max().item())


def test_no_kernels_without_torch_compile() -> None:
    with torch._dynamo.config.patch(disable=True):
        assert fused.kernels_for(QuantType.Q8_0) is None
    assert fused.kernels_for(QuantType.MXFP4) is None  # no kernel for this format


def _q2_model(dtype: torch.dtype, kernels: bool):
    """`ds4-tiny-q2` as the GGUF file is served: its weights packed, vLLM's CPU kernels bound."""
    from ds4_vllm.model.core import build_model
    from ds4_vllm.model.cpu_kernels import use_vllm_cpu_kernels
    from ds4_vllm.model.gguf_file import Ds4GgufFile
    from ds4_vllm.model.tiny_gguf import tiny_gguf_file

    gguf = Ds4GgufFile.open(tiny_gguf_file("ds4-tiny-q2"))
    model = build_model(gguf.config(), dtype)
    model.load_weights(gguf.tensors())
    if kernels:
        bound = use_vllm_cpu_kernels(model)["fused_packed"]
        packed = [m for m in model.modules() if getattr(m, "qtype", None) in fused.FUSED_TYPES]
        assert bound == len(packed) > 0 and all(m.fused is not None for m in packed)
    return model.eval()


def _steps(model) -> list[torch.Tensor]:
    """Logits of a prefill of two prompts (its layers take quant_linear: more rows than the
    kernels take; its LM head, two rows, a kernel), then four batch-2 decode steps (kernels)."""
    from ds4_vllm.model.paged_run import PagedRun

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1000, 100000, (n,), generator=g).tolist() for n in (300, 170)]
    run = PagedRun(model, 320, 2, "cpu")
    out = [run.step(prompts, [0, 1])]
    for token in (11, 12, 13, 14):
        out.append(run.step([[token], [token + 100]], [0, 1]))
    return out


#: float32 model, max |Δ logit| with the kernels against without (summation order): measured
#: 2.1e-6 to 3.2e-6 over the five steps; 10x that.
Q2_FLOAT32_LOGITS = 3e-5


def test_the_q2_model_with_fused_kernels_answers_as_without() -> None:
    with_kernels, without = (_steps(_q2_model(torch.float32, k)) for k in (True, False))
    gaps = [(a - b).abs().max().item() for a, b in zip(with_kernels, without, strict=True)]
    print("float32 |Δ logit| per step:", gaps)
    assert 0 < max(gaps) < Q2_FLOAT32_LOGITS  # > 0: the kernels did run
