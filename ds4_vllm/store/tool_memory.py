"""Exact replay: tool-call id -> the exact DSML block the model sampled (spec §4, ds4's tool memory).

Clients send tool calls back as JSON, and re-rendering JSON rarely gives back the sampled bytes
(key order, whitespace, number spelling). The renderer asks `ToolMemory.lookup(id)` for the sampled
block instead, so the next prompt stays a byte extension of the cached state.

- `ToolMemory` is the bounded map the API server keeps: at most `max_ids` ids (and 512 MiB of
  DSML); a lookup counts as a use, and the least recently used id goes first (ds4's order). An id
  matches only exactly: no prefix, no case folding, so a guessed or foreign id falls back to
  canonical rendering.
- `tool_call_id` derives the ids of one sampled block from a per-request secret seed. The API
  server (which answers with the ids) and the engine core (which writes the checkpoint holding the
  block, before the client has seen the ids) derive the same ids without talking to each other.
- `tool_map_for_text` is the KTM writer's scan: the entries whose block appears in a checkpoint's
  key text. `ToolMemory.load_directory` reads the trailers of the store's checkpoints back (at
  start-up, and for ids another server wrote) through the store's filesystem layer
  (`ds4_vllm.store.trailers`), without touching payloads.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import secrets
import threading
from collections.abc import Iterable, Mapping

from ds4_vllm.kvc import ToolMapEntry
from ds4_vllm.kvc.constants import KTM_MAX_DSML_BYTES, KTM_MAX_ID_BYTES

from .trailers import TOOL_MEMORY_MAX_BYTES, CheckpointTrailers

logger = logging.getLogger(__name__)

#: DS4_TOOL_MEMORY_DEFAULT_MAX_IDS.
DEFAULT_TOOL_MEMORY_MAX_IDS = 100_000
#: ds4's id prefixes (`random_tool_id`): Anthropic ids start with "toolu_", all others with "call_".
OPENAI_ID_PREFIX = "call_"
ANTHROPIC_ID_PREFIX = "toolu_"
#: 16 random bytes (128 bits) per seed and per id, as ds4's ids.
_ID_BYTES = 16

#: Block spellings the KTM writer scans for (`find_next_dsml_tool_block`), in its order.
_BLOCK_FORMS: tuple[tuple[bytes, bytes], ...] = (
    ("\n\n<｜DSML｜tool_calls>".encode(), "</｜DSML｜tool_calls>".encode()),
    ("<｜DSML｜tool_calls>".encode(), "</｜DSML｜tool_calls>".encode()),
    ("\n\n<DSML｜tool_calls>".encode(), "</DSML｜tool_calls>".encode()),
    ("<DSML｜tool_calls>".encode(), "</DSML｜tool_calls>".encode()),
    (b"\n\n<tool_calls>", b"</tool_calls>"),
    (b"<tool_calls>", b"</tool_calls>"),
)


def new_seed() -> str:
    """A fresh secret seed for one request's tool-call ids (128 random bits, hex)."""
    return secrets.token_hex(_ID_BYTES)


def tool_call_id(seed: str, dsml: str | bytes, index: int, prefix: str = OPENAI_ID_PREFIX) -> str:
    """The id of call `index` of the sampled block `dsml`: prefix + 32 hex digits.

    A keyed BLAKE2b of the block and the index: unguessable without the seed (which never leaves
    the server), distinct for distinct blocks of one request (several choices), and computable
    by both processes from what each of them has.
    """
    if isinstance(dsml, str):
        dsml = dsml.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(
        dsml + index.to_bytes(4, "little"), key=bytes.fromhex(seed), digest_size=_ID_BYTES
    )
    return prefix + digest.hexdigest()


def random_tool_id(prefix: str = OPENAI_ID_PREFIX) -> str:
    """An id for a call whose request carried no seed (ds4's `random_tool_id`)."""
    return prefix + secrets.token_hex(_ID_BYTES)


def find_tool_blocks(text: bytes) -> list[tuple[int, int]]:
    """(start, end) of each DSML block in a key text, left to right, as the KTM writer finds them:
    the earliest-starting spelling that is closed wins, the first listed on a tie."""
    blocks: list[tuple[int, int]] = []
    pos = 0
    while True:
        best: tuple[int, int] | None = None
        for opening, closing in _BLOCK_FORMS:
            start = text.find(opening, pos)
            if start < 0 or (best is not None and start >= best[0]):
                continue
            end = text.find(closing, start)
            if end < 0:
                continue
            best = (start, end + len(closing))
        if best is None:
            return blocks
        blocks.append(best)
        pos = best[1]


def tool_map_for_text(text: bytes, ids_by_block: Mapping[bytes, Iterable[str]]) -> list[ToolMapEntry]:
    """KTM entries for a checkpoint's key text: one per id of each block found in it (each block
    once). Ids longer than the reader's 256 bytes are left out (ds4's reader would stop at them)."""
    entries: list[ToolMapEntry] = []
    seen: set[bytes] = set()
    for start, end in find_tool_blocks(text):
        block = text[start:end]
        if block in seen:
            continue
        seen.add(block)
        for tool_id in ids_by_block.get(block, ()):
            raw_id = tool_id.encode("utf-8")
            if 1 <= len(raw_id) <= KTM_MAX_ID_BYTES:
                entries.append(ToolMapEntry(raw_id, block))
    return entries


class ToolMemory:
    """Bounded id -> DSML map of the API server (thread-safe)."""

    def __init__(
        self,
        max_ids: int = DEFAULT_TOOL_MEMORY_MAX_IDS,
        *,
        max_bytes: int = TOOL_MEMORY_MAX_BYTES,
        checkpoints: CheckpointTrailers | None = None,
    ) -> None:
        if max_ids < 1:
            raise ValueError(f"--tool-memory-max-ids / tool_memory_max_ids: must be >= 1, got {max_ids}")
        self.max_ids = max_ids
        self.max_bytes = max_bytes
        #: Where `load_directory` reads trailers: the store's filesystem (`ds4_vllm.store.fs`).
        self.checkpoints = checkpoints
        self._entries: collections.OrderedDict[str, str] = collections.OrderedDict()  # oldest first
        self._blocks: dict[str, str] = {}  # one shared string per distinct block
        self._block_refs: collections.Counter[str] = collections.Counter()
        self._bytes = 0
        self._lock = threading.Lock()
        self._scanned: dict[str, tuple[object, ...]] = {}  # file name -> listed stamp already read

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tool_id: object) -> bool:
        return tool_id in self._entries

    @property
    def nbytes(self) -> int:
        """DSML bytes held (a block shared by several ids counts once)."""
        return self._bytes

    def ids(self) -> list[str]:
        """Ids from the oldest (next to go) to the most recently used."""
        with self._lock:
            return list(self._entries)

    def remember(self, tool_id: str, dsml: str) -> None:
        """Map an id to its sampled block; it becomes the most recently used. Empty ids or blocks,
        and ids or blocks the KTM trailer could not hold, are not remembered."""
        raw_id = tool_id.encode("utf-8", "surrogatepass") if tool_id else b""
        if not 1 <= len(raw_id) <= KTM_MAX_ID_BYTES or not dsml:
            return
        if len(dsml.encode("utf-8", "surrogatepass")) > KTM_MAX_DSML_BYTES:
            return
        with self._lock:
            old = self._entries.get(tool_id)
            if old == dsml:
                self._entries.move_to_end(tool_id)
                return
            if old is not None:
                self._drop(tool_id)
            block = self._blocks.setdefault(dsml, dsml)
            if self._block_refs[block] == 0:
                self._bytes += len(block.encode("utf-8", "surrogatepass"))
            self._block_refs[block] += 1
            self._entries[tool_id] = block
            while len(self._entries) > self.max_ids or (
                self._bytes > self.max_bytes and len(self._entries) > 1
            ):
                self._drop(next(iter(self._entries)))

    def remember_calls(self, tool_ids: Iterable[str], dsml: str) -> None:
        """Every id of one sampled block."""
        for tool_id in tool_ids:
            self.remember(tool_id, dsml)

    def lookup(self, tool_id: str) -> str | None:
        """The exact block sampled for this id (a use: it becomes the most recent), or None."""
        with self._lock:
            block = self._entries.get(tool_id)
            if block is not None:
                self._entries.move_to_end(tool_id)
            return block

    def peek(self, tool_id: str) -> str | None:
        """Like `lookup`, without counting as a use."""
        return self._entries.get(tool_id)

    def _drop(self, tool_id: str) -> None:
        block = self._entries.pop(tool_id)
        self._block_refs[block] -= 1
        if self._block_refs[block] <= 0:
            del self._block_refs[block]
            del self._blocks[block]
            self._bytes -= len(block.encode("utf-8", "surrogatepass"))

    # ------------------------------------------------------------------ the checkpoint directory

    def load_directory(self) -> int:
        """Read the KTM trailers of checkpoint files not read before (new or changed since).

        Returns how many entries were taken. Only trailers are read, never payloads, through the
        store's filesystem layer (a local directory or an fsspec URL such as `s3://`); unreadable
        or foreign files are skipped: a bad trailer must not stop the server.
        """
        if self.checkpoints is None:
            return 0
        try:
            listed = self.checkpoints.list_checkpoints()
        except OSError as exc:
            logger.warning("tool memory: cannot list %s: %s", self.checkpoints.url, exc)
            return 0
        new = [c for c in listed if self._scanned.get(c.name) != c.stamp]
        new.sort(key=lambda c: (c.order, c.name))  # oldest first: the newest files' ids end up most recent
        taken = 0
        for listed_file in new:
            entries = self.checkpoints.read_tool_map(listed_file.path, self.max_bytes)
            self._scanned[listed_file.name] = listed_file.stamp
            for tool_id, dsml in entries or ():
                self.remember(tool_id, dsml)
                taken += 1
        return taken

    def restore(self, tool_ids: Iterable[str]) -> int:
        """When a request names ids this memory lacks, read the trailers written since the last
        read (ds4's per-request pre-scan): ids another server sharing the directory handed out
        replay here too. Costs a directory listing when nothing is new."""
        if all(not i or i in self._entries for i in tool_ids):
            return 0
        return self.load_directory()
