"""KTM trailers for the checkpoints of one request (exact replay, spec §4).

The API server keeps the tool memory; this process writes the checkpoints. What the writer needs
arrives with the request, in `kv_transfer_params` (see `ds4_vllm.serving.tool_replay`):

- `ds4_tool_map`: `[id, dsml]` of the calls in the request's history;
- `ds4_tool_ids`: the secret seed of the calls this request samples. The sampled block is parsed
  from the generated text exactly as the API server's tool parser parses it, and its ids derived
  from the seed, so the checkpoint saved when the request finishes already maps the ids the client
  is about to receive; a restart between two turns then loses nothing.

Each checkpoint gets the entries whose block appears in its key text (`tool_map_for_text`).
Malformed values are ignored entry by entry: a client-made request cannot break a save.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ds4_vllm.chat.dsml import parse_generated
from ds4_vllm.contracts import TOOL_IDS_KEY, TOOL_MAP_KEY
from ds4_vllm.kvc import ToolMapEntry
from ds4_vllm.kvc.constants import KTM_MAX_ID_BYTES
from ds4_vllm.store.tool_memory import OPENAI_ID_PREFIX, tool_call_id, tool_map_for_text

logger = logging.getLogger(__name__)


class RequestToolMap:
    """Which tool-call ids a request's checkpoints may carry, keyed by their exact DSML block."""

    def __init__(self, params: Any, prompt_text_bytes: int) -> None:
        self.prompt_text_bytes = prompt_text_bytes
        self.history: dict[bytes, list[str]] = {}
        self.seed: str | None = None
        self.prefix = OPENAI_ID_PREFIX
        if not isinstance(params, Mapping):
            return
        history = params.get(TOOL_MAP_KEY)
        for item in history if isinstance(history, list | tuple) else ():
            if (
                isinstance(item, list | tuple)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], str)
                and item[1]
                and 1 <= len(item[0].encode("utf-8", "surrogatepass")) <= KTM_MAX_ID_BYTES
            ):
                ids = self.history.setdefault(item[1].encode("utf-8", "surrogatepass"), [])
                if item[0] not in ids:
                    ids.append(item[0])
        spec = params.get(TOOL_IDS_KEY)
        if isinstance(spec, Mapping):
            seed, prefix = spec.get("seed"), spec.get("prefix", OPENAI_ID_PREFIX)
            if isinstance(seed, str) and _is_seed(seed):
                self.seed = seed
            if isinstance(prefix, str) and len(prefix) <= 32:
                self.prefix = prefix

    @property
    def empty(self) -> bool:
        return not self.history and self.seed is None

    def entries(self, text: bytes) -> list[ToolMapEntry]:
        """The KTM entries of a checkpoint whose key text is `text`."""
        if self.empty:
            return []
        by_block = dict(self.history)
        if self.seed is not None and len(text) > self.prompt_text_bytes:
            generated = text[self.prompt_text_bytes :].decode("utf-8", "replace")
            parsed = parse_generated(generated)
            if parsed.raw_dsml is not None and parsed.calls:
                block = parsed.raw_dsml.encode("utf-8", "surrogatepass")
                ids = [tool_call_id(self.seed, block, i, self.prefix) for i in range(len(parsed.calls))]
                by_block[block] = by_block.get(block, []) + [
                    i for i in ids if i not in by_block.get(block, [])
                ]
        return tool_map_for_text(text, by_block)


def _is_seed(seed: str) -> bool:
    try:
        return len(bytes.fromhex(seed)) == 16
    except ValueError:
        return False
