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
  key text. `load_tool_maps` reads the trailers of a checkpoint directory back (at start-up, and
  for ids another server wrote), without touching payloads.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from ds4_vllm.kvc import ExtFlag, KvcFormatError, ToolMapEntry
from ds4_vllm.kvc.constants import KTM_MAX_DSML_BYTES, KTM_MAX_ID_BYTES, KV_NAME_RE, PREFIX_BYTES
from ds4_vllm.kvc.file import open_regular_file
from ds4_vllm.kvc.header import unpack_prefix
from ds4_vllm.kvc.trailer import parse_tool_map

logger = logging.getLogger(__name__)

#: DS4_TOOL_MEMORY_DEFAULT_MAX_IDS.
DEFAULT_TOOL_MEMORY_MAX_IDS = 100_000
#: DS4_TOOL_MEMORY_MAX_BYTES: the memory also stops growing at this much DSML.
TOOL_MEMORY_MAX_BYTES = KTM_MAX_DSML_BYTES
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
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        if max_ids < 1:
            raise ValueError(f"--tool-memory-max-ids / tool_memory_max_ids: must be >= 1, got {max_ids}")
        self.max_ids = max_ids
        self.max_bytes = max_bytes
        self.directory = Path(directory) if directory is not None else None
        self._entries: collections.OrderedDict[str, str] = collections.OrderedDict()  # oldest first
        self._blocks: dict[str, str] = {}  # one shared string per distinct block
        self._block_refs: collections.Counter[str] = collections.Counter()
        self._bytes = 0
        self._lock = threading.Lock()
        self._scanned: dict[str, tuple[int, int]] = {}  # file name -> (size, mtime_ns) already read

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

        Returns how many entries were taken. Only trailers are read, never payloads; unreadable
        or foreign files are skipped: a bad trailer must not stop the server.
        """
        if self.directory is None or not self.directory.is_dir():
            return 0
        taken = 0
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as exc:
            logger.warning("tool memory: cannot list %s: %s", self.directory, exc)
            return 0
        files: list[tuple[int, str, tuple[int, int]]] = []
        for name in names:
            if not KV_NAME_RE.match(name):  # only checkpoints: ds4's scan takes <40 hex>.kv alone
                continue
            try:
                st = os.stat(self.directory / name, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):  # a link is never followed out of the directory
                continue
            stamp = (st.st_size, st.st_mtime_ns)
            if self._scanned.get(name) == stamp:
                continue
            files.append((st.st_mtime_ns, name, stamp))
        files.sort()  # oldest first, so the newest files' ids end up the most recent
        for _, name, stamp in files:
            entries = read_tool_map(self.directory / name, max_bytes=self.max_bytes, check_name=True)
            self._scanned[name] = stamp
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


def read_tool_map(
    path: str | os.PathLike[str], *, max_bytes: int = TOOL_MEMORY_MAX_BYTES, check_name: bool = False
) -> list[tuple[str, str]] | None:
    """(id, DSML) pairs of one checkpoint's KTM trailer, read the way ds4's reader reads it (a bad
    trailer is ignored, a bad entry ends it); None when the file is unreadable or not a checkpoint.

    The file is memory-mapped and at most `max_bytes` of ids and DSML are copied out of it (an
    entry past that ends the map, as a bad one does), whatever sizes the trailer claims. A link
    is not followed. With `check_name` (the directory scan) a file whose name is not the SHA-1
    of its text is not a checkpoint: None.
    """
    try:
        with open(open_regular_file(path, follow_symlinks=False), "rb") as fp:
            size = os.fstat(fp.fileno()).st_size
            header, text_bytes = unpack_prefix(fp.read(PREFIX_BYTES), size, path)
            if check_name and hashlib.sha1(fp.read(text_bytes)).hexdigest() != Path(path).name[:40].lower():
                logger.debug("tool memory: skipping %s: its name is not the SHA-1 of its text", path)
                return None
            if not header.ext_flags & ExtFlag.TOOL_MAP:
                return []
            at = PREFIX_BYTES + text_bytes + header.payload_bytes
            if at >= size:
                return []
            with mmap.mmap(fp.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                parsed = parse_tool_map(mm, at, size, path=path, strict=False, max_bytes=max_bytes)
    except (OSError, KvcFormatError) as exc:
        logger.debug("tool memory: skipping %s: %s", path, exc)
        return None
    out: list[tuple[str, str]] = []
    for entry in parsed.entries:
        try:
            out.append((entry.tool_id.decode("utf-8"), entry.dsml.decode("utf-8", "surrogatepass")))
        except UnicodeDecodeError:
            continue  # the renderer works on text; an id or block that is not UTF-8 cannot be replayed
    return out
