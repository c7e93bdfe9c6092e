"""The one place that knows both the paged cache layers and the DSV4 payload sections.

A checkpoint after T tokens holds, per layer: the raw rows of positions
T-R..T-1 (R = min(T, window)), compressed rows 0..T//ratio-1, the compressor
frontier in ds4's layout (ratio 128: rows 0..T%128-1 are the open window's
tokens; ratio 4: rows 0..3 the previous window, rows 4.. the open one; unused
rows are kv 0 / score -1e30), and on ratio-4 layers the indexer rows and
frontier. Our caches keep the compressor inputs per token, so converting is a
matter of which token each frontier row belongs to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ds4_vllm.kvc import LayerArrays, ModelDims

CLEARED_SCORE = -1e30  # ds4's initial/cleared frontier score
NULL_BLOCK = 0  # vLLM's placeholder block for positions outside a sliding window

#: One layer's frontier arrays by `LayerArrays` field name (raw, state_*, index_state_*).
Frontier = dict[str, np.ndarray]


class StateUnavailable(RuntimeError):
    """A row the checkpoint needs is no longer in vLLM's cache (its block was released)."""


@dataclass(frozen=True)
class CacheRole:
    name: str  # cache layer prefix, the key of register_kv_caches
    group: int  # KV cache group index (selects the block id list)
    block_size: int
    tokens_per_row: int = 1


@dataclass(frozen=True)
class LayerCaches:
    ratio: int
    raw: CacheRole
    comp: CacheRole | None = None
    state: CacheRole | None = None
    index_comp: CacheRole | None = None
    index_state: CacheRole | None = None


def frontier_tokens(n_tokens: int, ratio: int) -> list[int]:
    """Token position held by each frontier row of ds4's layout (-1: cleared row)."""
    if ratio == 128:
        start = n_tokens - n_tokens % 128
        return [start + j if start + j < n_tokens else -1 for j in range(128)]
    k = n_tokens % 4
    previous = [n_tokens - k - 4 + i for i in range(4)]
    current = [n_tokens - k + i if i < k else -1 for i in range(4)]
    return [p if p >= 0 else -1 for p in previous] + current


class Ds4KVLayout:
    """Copies one request's state between vLLM's paged caches and DSV4 payload arrays."""

    def __init__(self, config, role_of: Callable[[str], tuple[int, int]]) -> None:
        """``role_of(cache_name) -> (group index, group block size)`` from the KV cache config."""
        self.dims = ModelDims(
            config.num_hidden_layers, config.head_dim, config.index_head_dim, config.vocab_size
        )
        self.window = config.sliding_window
        self.layers: list[LayerCaches] = []
        self.group_block_sizes: dict[int, int] = {}
        for il, ratio in enumerate(config.compress_ratios):
            base = f"model.layers.{il}.self_attn"

            def role(suffix: str, tokens_per_row: int = 1, base: str = base) -> CacheRole:
                name = f"{base}.{suffix}"
                group, block_size = role_of(name)
                self.group_block_sizes[group] = block_size
                return CacheRole(name, group, block_size, tokens_per_row)

            if ratio == 0:
                self.layers.append(LayerCaches(0, role("swa_cache")))
                continue
            extra = {}
            if ratio == 4:
                extra = dict(
                    index_comp=role("compressor.indexer.kv_cache", 4),
                    index_state=role("compressor.indexer.state_cache"),
                )
            self.layers.append(
                LayerCaches(
                    ratio,
                    role("swa_cache"),
                    comp=role("compressor.kv_cache", ratio),
                    state=role("compressor.state_cache"),
                    **extra,
                )
            )

    def group_block_size(self, group: int) -> int:
        return self.group_block_sizes.get(group, 0)

    def cache_names(self) -> list[str]:
        names = []
        for layer in self.layers:
            for role in (layer.raw, layer.comp, layer.state, layer.index_comp, layer.index_state):
                if role is not None:
                    names.append(role.name)
        return names

    def counts(self, n_tokens: int) -> tuple[list[int], list[int]]:
        n_comp = [n_tokens // layer.ratio if layer.ratio else 0 for layer in self.layers]
        n_index = [n_tokens // 4 if layer.ratio == 4 else 0 for layer in self.layers]
        return n_comp, n_index

    # ------------------------------------------------------------------ addressing

    @staticmethod
    def _slots(role: CacheRole, block_ids: Sequence[Sequence[int]], positions: Sequence[int]):
        ids = block_ids[role.group]
        blocks, states = [], []
        for pos in positions:
            index = pos // role.block_size
            blocks.append(ids[index] if index < len(ids) else NULL_BLOCK)
            states.append((pos % role.block_size) // role.tokens_per_row)
        return torch.tensor(blocks, dtype=torch.long), torch.tensor(states, dtype=torch.long)

    def _read(self, caches, role: CacheRole, block_ids, positions: Sequence[int]) -> np.ndarray:
        cache = caches[role.name]
        if not positions:
            return np.zeros((0, cache.shape[-1]), dtype=np.float32)
        blocks, states = self._slots(role, block_ids, positions)
        if bool((blocks == NULL_BLOCK).any()):
            raise StateUnavailable(
                f"{role.name}: rows of positions {positions[0]}..{positions[-1]} were released"
            )
        return cache[blocks.to(cache.device), 0, states.to(cache.device)].to(torch.float32).cpu().numpy()

    def _write(
        self, caches, role: CacheRole, block_ids, positions: Sequence[int], rows, start: int = 0
    ) -> None:
        if start:
            # Rows below `start` are in blocks vLLM's prefix cache shares with other requests.
            keep_rows = [i for i, p in enumerate(positions) if p >= start]
            positions = [positions[i] for i in keep_rows]
            rows = np.asarray(rows)[keep_rows]
        if not positions:
            return
        cache = caches[role.name]
        blocks, states = self._slots(role, block_ids, positions)
        keep = blocks != NULL_BLOCK  # rows outside the window vLLM allocated are not needed
        if not bool(keep.any()):
            return
        # Boolean indexing copies, so a read-only (memory-mapped) payload becomes a writable array.
        values = torch.from_numpy(np.asarray(rows)[keep.numpy()])
        cache[blocks[keep].to(cache.device), 0, states[keep].to(cache.device)] = values.to(
            cache.device, cache.dtype
        )

    # ------------------------------------------------------------------ cache -> payload

    def extract(
        self, caches, block_ids, n_tokens: int, frontier: Sequence[Frontier] | None = None
    ) -> list[LayerArrays]:
        """Payload arrays (float32 copies) of the state after ``n_tokens`` tokens.

        ``frontier``: the rows `extract_frontier` copied while the request held exactly
        ``n_tokens`` tokens; the compressed rows below it never change, so the state can be
        saved later, once vLLM has released the window's blocks.
        """
        if frontier is None:
            frontier = self.extract_frontier(caches, block_ids, n_tokens)
        n_comp, n_index = self.counts(n_tokens)
        out = []
        for il, (layer, front) in enumerate(zip(self.layers, frontier, strict=True)):
            arrays = dict(front)
            if layer.ratio:
                arrays["comp"] = self._comp_rows(caches, layer.comp, block_ids, n_comp[il])
            if layer.ratio == 4:
                arrays["index_comp"] = self._comp_rows(caches, layer.index_comp, block_ids, n_index[il])
            out.append(LayerArrays(**arrays))
        return out

    def extract_frontier(self, caches, block_ids, n_tokens: int) -> list[Frontier]:
        """The part of the state after ``n_tokens`` that later tokens overwrite or release, per
        layer: the raw window rows and the compressors' open windows (a few hundred rows, however
        long the context)."""
        raw_positions = list(range(max(0, n_tokens - self.window), n_tokens))
        out: list[Frontier] = []
        for layer in self.layers:
            arrays = {"raw": self._raw_rows(caches, layer.raw, block_ids, raw_positions, n_tokens)}
            if layer.ratio:
                arrays["state_kv"], arrays["state_score"] = self._frontier(
                    caches, layer.state, block_ids, n_tokens, layer.ratio
                )
            if layer.ratio == 4:
                arrays["index_state_kv"], arrays["index_state_score"] = self._frontier(
                    caches, layer.index_state, block_ids, n_tokens, 4
                )
            out.append(arrays)
        return out

    def _raw_rows(
        self, caches, role: CacheRole, block_ids, positions: list[int], n_tokens: int
    ) -> np.ndarray:
        """The format keeps ``window`` raw rows, but continuing only reads the last ``window - 1``:
        the next token sees itself plus those. vLLM may already have released the oldest one
        (a finished request keeps only its next token's window); it is then written as zeros."""
        oldest = n_tokens - self.window
        if positions and positions[0] == oldest:
            blocks, _ = self._slots(role, block_ids, positions[:1])
            if int(blocks[0]) == NULL_BLOCK:
                rest = self._read(caches, role, block_ids, positions[1:])
                return np.concatenate([np.zeros((1, rest.shape[1]), dtype=np.float32), rest])
        return self._read(caches, role, block_ids, positions)

    def _comp_rows(self, caches, role: CacheRole, block_ids, count: int) -> np.ndarray:
        return self._read(caches, role, block_ids, [c * role.tokens_per_row for c in range(count)])

    def _frontier(self, caches, role: CacheRole, block_ids, n_tokens: int, ratio: int):
        owners = frontier_tokens(n_tokens, ratio)
        live = [i for i, p in enumerate(owners) if p >= 0]
        rows = self._read(caches, role, block_ids, [owners[i] for i in live])
        width = rows.shape[1] // 2
        kv = np.zeros((len(owners), width), dtype=np.float32)
        score = np.full((len(owners), width), CLEARED_SCORE, dtype=np.float32)
        kv[live], score[live] = rows[:, :width], rows[:, width:]
        return kv, score

    # ------------------------------------------------------------------ payload -> cache

    def restore(self, caches, block_ids, layers: Sequence, n_tokens: int, start: int = 0) -> None:
        """Write a checkpoint's state after ``n_tokens`` tokens into one request's blocks.

        Positions below ``start`` are left alone (vLLM already holds them).
        """
        raw_positions = list(range(max(0, n_tokens - self.window), n_tokens))
        for layer, arrays in zip(self.layers, layers, strict=True):
            self._write(caches, layer.raw, block_ids, raw_positions, arrays.raw, start)
            if layer.ratio:
                self._write_comp(caches, layer.comp, block_ids, arrays.comp, start)
                self._write_frontier(caches, layer.state, block_ids, n_tokens, layer.ratio, arrays, start)
            if layer.ratio == 4:
                self._write_comp(caches, layer.index_comp, block_ids, arrays.index_comp, start)
                self._write_frontier(
                    caches, layer.index_state, block_ids, n_tokens, 4, arrays, start, index=True
                )

    def _write_comp(self, caches, role: CacheRole, block_ids, rows, start: int) -> None:
        positions = [c * role.tokens_per_row for c in range(len(rows))]
        self._write(caches, role, block_ids, positions, rows, start)

    def _write_frontier(self, caches, role, block_ids, n_tokens, ratio, arrays, start, index: bool = False):
        kv = arrays.index_state_kv if index else arrays.state_kv
        score = arrays.index_state_score if index else arrays.state_score
        owners = frontier_tokens(n_tokens, ratio)
        live = [i for i, p in enumerate(owners) if p >= 0]
        rows = np.concatenate([np.asarray(kv)[live], np.asarray(score)[live]], axis=1)
        self._write(caches, role, block_ids, [owners[i] for i in live], rows, start)
