"""Throughput of dequantizing each packed weight type, next to gguf-py's numpy reference.

One DeepSeek V4 Flash routed-expert matrix ([2048, 4096], 8.4 M values) per type, random
bytes with finite scales. For each: packed MB/s read and M values/s written, to float32 and
to bfloat16, plus gguf-py's numpy dequantizer on the same bytes for the GGUF types. Prints a
table; asserts nothing. F32 to float32 and BF16 to bfloat16 are zero-copy views ("view").

    python -m benchmarks.dequant_speed [--repeat 5] [--threads N] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ds4_vllm.model.quant import QuantizedWeight, QuantType, block_layout, packed_shape, scale_shape
from ds4_vllm.model.quant.dequant import dequantize

SHAPE = (2048, 4096)
FP16_FIELDS = {
    QuantType.Q8_0: (0,),
    QuantType.Q2_K: (80, 82),
    QuantType.Q4_K: (0, 2),
    QuantType.IQ2_XXS: (0,),
}


def random_weight(qtype: QuantType, device: str) -> QuantizedWeight:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=packed_shape(qtype, SHAPE), dtype=np.uint8)
    if qtype in FP16_FIELDS:
        for offset in FP16_FIELDS[qtype]:
            raw.reshape(-1, block_layout(qtype)[1])[:, offset + 1] &= 0x3F  # finite fp16 scales
    elif qtype in (QuantType.F16, QuantType.BF16, QuantType.F32):
        itemsize = 4 if qtype is QuantType.F32 else 2
        raw.reshape(-1, itemsize)[:, -1] &= 0x3F
    scale = None
    if (want := scale_shape(qtype, SHAPE)) is not None:
        scale = torch.from_numpy(rng.integers(120, 130, size=want, dtype=np.uint8))
    return QuantizedWeight(qtype, SHAPE, torch.from_numpy(raw), scale).to(device)


def best_seconds(fn, repeat: int) -> float:
    fn()  # warm-up: table copies, allocator
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    values = SHAPE[0] * SHAPE[1]
    print(f"device={args.device} torch threads={torch.get_num_threads()} shape={SHAPE} best of {args.repeat}")
    print(
        f"{'type':10} {'packed MB':>9} {'f32 MB/s':>9} {'f32 Mval/s':>10} {'bf16 Mval/s':>11} {'gguf-py Mval/s':>14}"
    )
    for qtype in QuantType:
        weight = random_weight(qtype, args.device)
        f32 = best_seconds(lambda w=weight: dequantize(w), args.repeat)
        bf16 = best_seconds(lambda w=weight: dequantize(w, dtype=torch.bfloat16), args.repeat)
        reference = ""
        if qtype.is_gguf_block or qtype is QuantType.F16:
            raw, gtype = weight.data.cpu().numpy(), GGMLQuantizationType[qtype.value]
            seconds = best_seconds(lambda r=raw, t=gtype: gguf_dequantize(r, t), 2)
            reference = f"{values / seconds / 1e6:14.0f}"
        mb = weight.nbytes / 1e6
        source = {QuantType.F32: torch.float32, QuantType.BF16: torch.bfloat16}.get(qtype)
        f32_rate = "view" if source == torch.float32 else f"{values / f32 / 1e6:.0f}"
        bf16_rate = "view" if source == torch.bfloat16 else f"{values / bf16 / 1e6:.0f}"
        f32_mb = "view" if source == torch.float32 else f"{mb / f32:.0f}"
        print(f"{qtype.value:10} {mb:9.1f} {f32_mb:>9} {f32_rate:>10} {bf16_rate:>11} {reference}")


if __name__ == "__main__":
    main()
