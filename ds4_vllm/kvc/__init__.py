"""Byte-compatible reader and writer of ds4 (DwarfStar 4) KVC checkpoint files.

Pure Python + numpy: no torch, no vLLM (a test enforces it). Format: docs/kvc.md and
shared/specs/kvc-format.md. Every defect in a file (or in data given to the writer)
raises `KvcFormatError(path, offset, field, reason)`; I/O failures raise OSError.

Typical use by a connector:

    # save: stream one layer at a time (arrays, or a callable producing them)
    hdr = PayloadHeader.build(dims, ctx_size=ctx, n_tokens=T)
    n_comp, n_index = default_counts(dims.n_layer, T)
    data = PayloadData(hdr, tokens, logits, n_comp, n_index, layers=lambda il: LayerArrays(...))
    path = write_checkpoint(cache_dir, text, KvcHeader.new(quant_bits=2, reason=SaveReason.COLD,
                            tokens=T, ctx_size=ctx), data)

    # load: longest stored prefix of the prompt, then read-only views of its arrays
    index = CheckpointIndex(cache_dir); index.refresh()
    found = index.lookup(prompt_bytes, min_tokens=512, ctx_size=ctx)
    if found.hit:
        with open_checkpoint(found.hit.path) as ck:
            raw0 = ck.payload.layers[0].raw      # np.ndarray [R, D] float32, a view of the file
        touch_checkpoint(found.hit.path)
"""

from .constants import ExtFlag, SaveReason, layer_compress_ratio
from .errors import KvcFormatError
from .file import (
    Checkpoint,
    Prefix,
    checkpoint_file_size,
    checkpoint_name,
    clean_temp_files,
    ensure_directory,
    open_checkpoint,
    parse_checkpoint,
    read_prefix,
    rewrite_tool_map,
    text_sha1,
    touch_checkpoint,
    write_checkpoint,
)
from .header import KvcHeader
from .index import CheckpointIndex, IndexEntry, LookupResult, RefreshStats
from .lookup import common_prefix
from .payload import LayerArrays, Payload, PayloadData
from .payload_layout import (
    DS4_FLASH,
    ModelDims,
    PayloadHeader,
    PayloadLayout,
    compute_layout,
    default_counts,
    payload_size,
)
from .trailer import ToolMap, ToolMapEntry

__all__ = [
    "DS4_FLASH",
    "Checkpoint",
    "CheckpointIndex",
    "ExtFlag",
    "IndexEntry",
    "KvcFormatError",
    "KvcHeader",
    "LayerArrays",
    "LookupResult",
    "common_prefix",
    "ModelDims",
    "Payload",
    "PayloadData",
    "PayloadHeader",
    "PayloadLayout",
    "Prefix",
    "RefreshStats",
    "SaveReason",
    "ToolMap",
    "ToolMapEntry",
    "checkpoint_file_size",
    "checkpoint_name",
    "clean_temp_files",
    "compute_layout",
    "default_counts",
    "ensure_directory",
    "layer_compress_ratio",
    "open_checkpoint",
    "parse_checkpoint",
    "payload_size",
    "read_prefix",
    "rewrite_tool_map",
    "text_sha1",
    "touch_checkpoint",
    "write_checkpoint",
]
