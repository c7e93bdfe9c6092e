"""Every number of the KVC file format, in one place (spec: shared/specs/kvc-format.md).

The reader, the writer, the index and the CLI import these names; no literal of the
format appears anywhere else.
"""

from __future__ import annotations

import enum
import re

# ---------------------------------------------------------------------------
# File name (spec §2.1)
# ---------------------------------------------------------------------------
KV_SUFFIX = ".kv"
#: A checkpoint name is 40 hex digits of SHA-1(text) + ".kv". ds4 accepts upper-case hex
#: when scanning and lower-cases it; we write lower case only.
KV_NAME_RE = re.compile(r"^[0-9a-fA-F]{40}\.kv$")
KV_NAME_LEN = 43
#: Temp files are "<sha1>.kv.tmp.<pid>" (ds4) or "<sha1>.kv.tmp.<pid>.<random>" (ours).
TMP_MARKER = ".kv.tmp."
TMP_NAME_RE = re.compile(r"^[0-9a-fA-F]{40}\.kv\.tmp\.(?P<pid>[0-9]+)(?:\.[0-9A-Za-z_-]+)?$")
#: Spec §11.5: we create checkpoint files 0600 and the cache directory 0700.
FILE_MODE = 0o600
DIR_MODE = 0o700

# ---------------------------------------------------------------------------
# Fixed header (spec §2.3). Offsets are byte offsets from the start of the file.
# ---------------------------------------------------------------------------
KVC_MAGIC = b"KVC"
KVC_VERSION = 1
FIXED_HEADER_BYTES = 48
#: The fixed header plus the u32 text length: what every reader reads as one unit.
PREFIX_BYTES = 52
#: struct layout of the 48 bytes: magic, version, quant, reason, ext, reserved u8, tokens,
#: hits, ctx, reserved u32, created_at, last_used, payload_bytes.
HEADER_STRUCT = "<3sBBBBBIIIIQQQ"
TEXT_LEN_STRUCT = "<I"


class HeaderOffset(enum.IntEnum):
    """Byte offset of each fixed-header field (spec §2.3 table)."""

    MAGIC = 0
    VERSION = 3
    QUANT_BITS = 4
    REASON = 5
    EXT_FLAGS = 6
    RESERVED0 = 7
    TOKENS = 8
    HITS = 12
    CTX_SIZE = 16
    RESERVED1 = 20
    CREATED_AT = 24
    LAST_USED = 32
    PAYLOAD_BYTES = 40
    TEXT_BYTES = 48


#: Routed-expert quant bits of the writing model: 2 (IQ2_XXS build) or 4 (Q4_K build).
VALID_QUANT_BITS = (2, 4)

U32_MAX = 0xFFFFFFFF
U64_MAX = 0xFFFFFFFFFFFFFFFF


class SaveReason(enum.IntEnum):
    """Why a checkpoint was written (`ds4_kvstore_reason_code`); unknown codes read as UNKNOWN."""

    UNKNOWN = 0
    COLD = 1
    CONTINUED = 2
    EVICT = 3
    SHUTDOWN = 4
    AGENT_SYSTEM = 5
    AGENT_SESSION = 6

    @classmethod
    def _missing_(cls, value: object) -> SaveReason:
        return cls.UNKNOWN

    @property
    def label(self) -> str:
        """The name ds4 prints in its logs ("cold", "agent-system", ...)."""
        return self.name.lower().replace("_", "-")


class ExtFlag(enum.IntFlag):
    """Header byte 6. Only TOOL_MAP adds bytes (the KTM trailer); bits 1-2 describe the text."""

    TOOL_MAP = 1
    RESPONSES_VISIBLE = 2
    THINKING_VISIBLE = 4


def key_kind(ext_flags: int) -> str:
    """What the key text is (`ds4_kvstore_key_kind`): bit1 wins over bit2."""
    if ext_flags & ExtFlag.RESPONSES_VISIBLE:
        return "responses-visible"
    if ext_flags & ExtFlag.THINKING_VISIBLE:
        return "thinking-visible"
    return "token-text"


# ---------------------------------------------------------------------------
# DSV4 payload (spec §3)
# ---------------------------------------------------------------------------
PAYLOAD_MAGIC = 0x34565344  # bytes "DSV4"
PAYLOAD_VERSION = 1
PAYLOAD_HEADER_WORDS = 13
PAYLOAD_HEADER_BYTES = 4 * PAYLOAD_HEADER_WORDS
#: Names of the 13 payload-header words, in file order (spec §3.2).
PAYLOAD_HEADER_FIELDS = (
    "magic",
    "version",
    "ctx_size",
    "prefill_cap",
    "raw_cap",
    "raw_window",
    "comp_cap",
    "n_tokens",
    "n_layer",
    "head_dim",
    "index_dim",
    "n_vocab",
    "raw_live",
)
#: On-disk element types: all floats are f32 LE, all ids and counts u32 LE (spec §3.3).
F32 = "<f4"
U32 = "<u4"
#: Per-layer sections in file order (spec §3.3 step 5). Which ones a layer has depends on
#: its compression ratio: all layers have "raw"; ratio != 0 adds comp + attention state;
#: ratio == 4 adds the indexer sections.
LAYER_SECTIONS = (
    "raw",
    "comp",
    "state_kv",
    "state_score",
    "index_comp",
    "index_state_kv",
    "index_state_score",
)
#: Ratio-4 layers keep overlapping windows, so their state has twice the rows and width.
INDEXED_RATIO = 4
SPARSE_RATIO = 128
#: Initial compressor state values (kv 0.0, score -1e30), spec §3.1.
STATE_KV_INIT = 0.0
STATE_SCORE_INIT = -1e30
#: Untrusted payloads may not claim more layers than this. Dense layers with no raw rows
#: take zero bytes, so the byte count alone does not bound the per-layer loop.
MAX_LAYERS = 4096


def layer_compress_ratio(layer: int) -> int:
    """ds4's layer rule (`ds4_layer_compress_ratio`): 0,1 dense; even >= 2 -> 4; odd >= 3 -> 128."""
    if layer < 2:
        return 0
    return INDEXED_RATIO if layer % 2 == 0 else SPARSE_RATIO


def state_coff(ratio: int) -> int:
    """Overlap factor of a compressor state: 2 for ratio 4, else 1."""
    return 2 if ratio == INDEXED_RATIO else 1


# DeepSeek V4 Flash (spec §3.1). The payload header carries these, so they are defaults
# for writers and sanity references for tests, never assumptions of the reader.
DS4_N_LAYER = 43
DS4_N_HEAD_DIM = 512
DS4_N_INDEXER_HEAD_DIM = 128
DS4_N_VOCAB = 129280
DS4_N_SWA = 128
#: Prefill chunk used when ctx > 2048 (`ds4_default_prefill_cap_for_prompt`).
DS4_PREFILL_CAP = 2048

# ---------------------------------------------------------------------------
# KTM tool-id map trailer (spec §4)
# ---------------------------------------------------------------------------
KTM_MAGIC = b"KTM"
KTM_VERSION = 1
KTM_HEADER_STRUCT = "<3sBI"
KTM_HEADER_BYTES = 8
KTM_ENTRY_STRUCT = "<II"
KTM_ENTRY_HEADER_BYTES = 8
KTM_MAX_ID_BYTES = 256
KTM_MAX_DSML_BYTES = 512 * 1024 * 1024  # DS4_TOOL_MEMORY_MAX_BYTES
#: 4 x the default tool_memory_max_entries (100 000): larger counts are rejected whole.
KTM_MAX_ENTRIES = 4 * 100_000
