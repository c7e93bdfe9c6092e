"""DSV4 payload: golden header, the §3.4 size formula, layout rules, writer input checks."""

from __future__ import annotations

import io

import numpy as np
import pytest

from ds4_vllm.kvc import (
    DS4_FLASH,
    KvcFormatError,
    LayerArrays,
    ModelDims,
    PayloadData,
    PayloadHeader,
    compute_layout,
    default_counts,
    payload_size,
)
from ds4_vllm.kvc.payload import parse_payload, write_payload
from tests.kvc.kvc_helpers import MICRO, TINY, random_payload

# spec §3.2 example: graph backend, ctx = 100000, T = 2048
SPEC_PAYLOAD_HEADER = bytes.fromhex(
    "44 53 56 34 01 00 00 00 a0 86 01 00 00 08 00 00 00 09 00 00 80 00 00 00"
    "aa 61 00 00 00 08 00 00 2b 00 00 00 00 02 00 00 80 00 00 00 00 f9 01 00"
    "80 00 00 00"
)


def test_payload_header_golden() -> None:
    header = PayloadHeader.build(DS4_FLASH, ctx_size=100000, n_tokens=2048, raw_cap=2304)
    assert header.pack() == SPEC_PAYLOAD_HEADER
    assert PayloadHeader.unpack(SPEC_PAYLOAD_HEADER) == header
    assert header.as_dict()["comp_cap"] == 25002


@pytest.mark.parametrize(
    ("n_tokens", "expected"),
    [
        (512, 31_042_956),
        (2048, 52_184_460),
        (10240, 164_939_148),
        (28672, 418_637_196),
        (65536, 926_033_292),
        (100000, 1_400_385_548),
    ],
)
def test_size_formula_flash(n_tokens: int, expected: int) -> None:
    header = PayloadHeader.build(DS4_FLASH, ctx_size=1_048_576, n_tokens=n_tokens)
    assert payload_size(header) == expected
    r = min(128, n_tokens)
    closed = 12_723_596 + 4 * n_tokens + 88_064 * r + 53_760 * (n_tokens // 4) + 40_960 * (n_tokens // 128)
    assert closed == expected


def test_layer_rule_and_state_shapes_flash() -> None:
    header = PayloadHeader.build(DS4_FLASH, ctx_size=100000, n_tokens=2048)
    n_comp, n_index = default_counts(43, 2048)
    layout = compute_layout(header, n_comp, n_index)
    ratios = [lay.ratio for lay in layout.layers]
    assert ratios[:4] == [0, 0, 4, 128] and ratios.count(4) == 21 and ratios.count(128) == 20
    four, one28 = layout.layers[2], layout.layers[3]
    assert [s.name for s in layout.layers[0].sections] == ["raw"]
    assert four.section("state_kv").shape == (8, 1024) and four.section("state_kv").nbytes == 32768
    assert four.section("index_state_kv").shape == (8, 256) and four.section("index_state_kv").nbytes == 8192
    assert one28.section("state_kv").shape == (128, 512) and one28.section("state_kv").nbytes == 262144
    assert one28.section("index_comp") is None
    assert n_comp[2] == 512 and n_comp[3] == 16 and n_index[2] == 512 and n_index[3] == 0


def _bytes_of(data: PayloadData) -> bytes:
    out = io.BytesIO()
    n = write_payload(out.write, data)
    assert n == len(out.getvalue())
    return out.getvalue()


@pytest.mark.parametrize("n_tokens", [1, 3, 5, 127, 128, 129, 131, 300])
def test_payload_round_trip_micro(n_tokens: int) -> None:
    rng = np.random.default_rng(n_tokens)
    data = random_payload(MICRO, n_tokens, rng, ctx_size=1024)
    raw = _bytes_of(data)
    assert len(raw) == payload_size(data.header, data.n_comp, data.n_index_comp)
    view = parse_payload(raw, 0, len(raw))
    assert view.header == data.header
    np.testing.assert_array_equal(view.tokens, data.tokens)
    np.testing.assert_array_equal(view.logits, data.logits)
    for got, want in zip(view.layers, data.layers, strict=True):
        for name in (
            "raw",
            "comp",
            "state_kv",
            "state_score",
            "index_comp",
            "index_state_kv",
            "index_state_score",
        ):
            w = getattr(want, name)
            g = getattr(got, name)
            assert (g is None) == (w is None)
            if w is not None:
                np.testing.assert_array_equal(g, w)
                assert not g.flags.writeable
    assert _bytes_of(view) == raw


def test_writer_accepts_callable_and_mappings() -> None:
    rng = np.random.default_rng(1)
    data = random_payload(MICRO, 9, rng, ctx_size=64)
    raw = _bytes_of(data)
    calls = []

    def layer(il: int) -> dict:
        calls.append(il)
        lay = data.layers[il]
        return {k: getattr(lay, k) for k in lay.__dataclass_fields__ if getattr(lay, k) is not None}

    streamed = PayloadData(data.header, data.tokens, data.logits, data.n_comp, data.n_index_comp, layer)
    assert _bytes_of(streamed) == raw
    assert calls == list(range(MICRO.n_layer))
    as_iter = PayloadData(
        data.header, data.tokens, data.logits, data.n_comp, data.n_index_comp, iter(data.layers)
    )
    assert _bytes_of(as_iter) == raw


def test_float64_input_is_converted() -> None:
    rng = np.random.default_rng(2)
    data = random_payload(MICRO, 4, rng, ctx_size=64)
    raw = _bytes_of(data)
    data.logits = data.logits.astype(np.float64)
    data.layers = [
        LayerArrays(**{k: (None if v is None else v.astype(np.float64)) for k, v in vars_(lay).items()})
        for lay in data.layers
    ]
    assert _bytes_of(data) == raw


def vars_(lay: LayerArrays) -> dict:
    return {k: getattr(lay, k) for k in lay.__dataclass_fields__}


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: setattr(d, "tokens", d.tokens[:-1]), "tokens"),
        (lambda d: setattr(d, "tokens", d.tokens.astype(np.int64) - 10**6), "tokens"),
        (lambda d: setattr(d, "tokens", d.tokens.astype(np.float32)), "tokens"),
        (lambda d: setattr(d, "logits", d.logits[:3]), "logits"),
        (lambda d: setattr(d.layers[2], "comp", d.layers[2].comp[:-1]), "layer[2].comp"),
        (lambda d: setattr(d.layers[2], "index_state_kv", None), "layer[2].index_state_kv"),
        (lambda d: setattr(d.layers[0], "comp", np.ones((2, 8), np.float32)), "layer[0].comp"),
        (lambda d: setattr(d, "layers", d.layers[:-1]), "layers"),
        (lambda d: setattr(d, "layers", d.layers + d.layers[:1]), "layers"),
        (lambda d: setattr(d, "n_comp", [1] + list(d.n_comp[1:])), "payload.n_comp[0]"),
        (
            lambda d: setattr(d, "n_index_comp", list(d.n_index_comp[:3]) + [1] + list(d.n_index_comp[4:])),
            "payload.n_index_comp[3]",
        ),
    ],
)
def test_writer_rejects_inconsistent_input(mutate, field: str) -> None:
    data = random_payload(MICRO, 10, np.random.default_rng(3), ctx_size=64)
    mutate(data)
    with pytest.raises(KvcFormatError) as info:
        _bytes_of(data)
    assert info.value.field == field


def test_header_rules() -> None:
    dims = ModelDims(3, 8, 4, 16)
    ok = PayloadHeader.build(dims, ctx_size=64, n_tokens=10)
    compute_layout(ok, *default_counts(3, 10))
    bad_live = PayloadHeader(**{**ok.as_dict(), "raw_live": 9})
    with pytest.raises(KvcFormatError, match="raw_live"):
        compute_layout(bad_live, *default_counts(3, 10))
    too_many = PayloadHeader(**{**ok.as_dict(), "n_layer": 5000})
    with pytest.raises(KvcFormatError, match="n_layer"):
        compute_layout(too_many, [0] * 5000, [0] * 5000)
    over_cap = PayloadHeader(**{**ok.as_dict(), "comp_cap": 1})
    with pytest.raises(KvcFormatError, match="comp_cap"):
        compute_layout(over_cap, *default_counts(3, 10))


def test_window_smaller_than_tokens_and_tiny_shape() -> None:
    header = PayloadHeader.build(TINY, ctx_size=16384, n_tokens=2048)
    assert (
        header.raw_live == 128
        and header.raw_cap == 128
        and header.comp_cap == 4098
        and header.prefill_cap == 2048
    )
    small = PayloadHeader.build(TINY, ctx_size=1000, n_tokens=50)
    assert small.raw_live == 50 and small.prefill_cap == 1000
