"""Paged per-sequence state of DeepSeek V4, and each step's addressing of it (no vLLM here).

Each role of the state (raw sliding-window rows, compressed rows, indexer rows, per-token
compressor inputs) is one `PagedState`: blocks of rows addressed through a block table. Every row
sits in a slot fixed by its token position, so recomputing a token rewrites the same slot: the
layout is idempotent under vLLM's recompute of the last prompt token, prefix caching, preemption
and connector restores.

The states only describe and address memory; the math lives in ``attention.py``. Reads and writes
go through ``kv[block, 0, state]`` indexing because vLLM's packed (BLHNC) layout hands out strided
per-layer views. Under vLLM each state is a `cache_layers.Ds4CacheLayer`, which vLLM's hybrid KV
cache manager allocates; without vLLM (tests, the GPU check) the caller binds ``kv_cache`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

# Block sizes (tokens per block) per role. vLLM's own DeepSeek V4 port uses the
# same numbers: the scheduler block is their lcm (256), so prefix-cache hits land
# on multiples of 256 tokens.
RAW_WINDOW_BLOCK = 64
COMPRESSED_BLOCK = 256
STATE_BLOCK = {4: 4, 128: 8}


@dataclass(frozen=True)
class StateSpec:
    """What one role of the state holds: rows of ``head_size`` values of ``dtype`` in blocks of
    ``block_size`` tokens, one row per ``tokens_per_row`` tokens; ``window`` > 0 keeps only the last
    ``window`` tokens' rows (a sliding window)."""

    block_size: int
    head_size: int
    dtype: torch.dtype
    tokens_per_row: int = 1
    window: int = 0


@dataclass
class Ds4CacheMetadata:
    """One group's addressing for one step (built once per step, shared by the group's layers)."""

    block_table: torch.Tensor  # [num_reqs, width] int32 block ids of this group
    block_size: int  # the group's final block size (vLLM may rescale the spec's)
    query_start_loc: torch.Tensor  # [num_reqs + 1] CPU
    seq_lens: torch.Tensor  # [num_reqs] CPU, tokens including this step's
    num_reqs: int
    #: vLLM's device copy of `query_start_loc`: the plan's per-token request ids are computed from
    #: it on the device (no host-made tensor to copy in each step). None: built from the host copy.
    query_start_loc_device: torch.Tensor | None = None
    #: Tokens in the step's input, padding included (vLLM pads a batch to a CUDA graph's size);
    #: None: exactly the requests' tokens.
    num_tokens: int | None = None
    #: A bound on every request's length that does not change from step to step (the model's
    #: context length): decode steps then gather the same number of compressed rows every step,
    #: as a replayed CUDA graph must. None: the longest request of this step.
    static_seq_len: int | None = None

    @cached_property
    def plan(self) -> BatchPlan:
        return BatchPlan(
            self.query_start_loc[: self.num_reqs + 1].tolist(),
            self.seq_lens[: self.num_reqs].tolist(),
            device=self.block_table.device,
            query_start_loc_device=(
                None
                if self.query_start_loc_device is None
                else self.query_start_loc_device[: self.num_reqs + 1]
            ),
            num_tokens=self.num_tokens,
            static_seq_len=self.static_seq_len,
        )

    @cached_property
    def request_blocks(self) -> torch.Tensor:
        """The block table, one row per request, then a row of vLLM's null block (block 0) for
        padding tokens: what they write lands where no request reads. Always there, so that a
        graph captured without padding replays with it."""
        table = self.block_table[: self.num_reqs]
        return torch.cat([table, torch.zeros_like(table[:1])])


class BatchPlan:
    """Where each request's tokens of this step sit: queries [q_start, q_end) at positions [pos_start, seq_len)."""

    def __init__(
        self,
        query_start_loc: list[int],
        seq_lens: list[int],
        device: torch.device | str = "cpu",
        query_start_loc_device: torch.Tensor | None = None,
        num_tokens: int | None = None,
        static_seq_len: int | None = None,
    ) -> None:
        self.q_start = query_start_loc[:-1]
        self.q_end = query_start_loc[1:]
        self.seq_len = seq_lens
        self.num_tokens = query_start_loc[-1] if num_tokens is None else num_tokens
        #: Tokens after the last request's (vLLM's padding to a CUDA graph's batch size).
        self.padding_tokens = self.num_tokens - query_start_loc[-1]
        self.pos_start = [s - (e - b) for s, b, e in zip(seq_lens, self.q_start, self.q_end, strict=True)]
        self._closing: dict[int, torch.Tensor | None] = {}
        #: No request has more than one token this step (vLLM's padding requests have none):
        #: attention runs for all of them at once, and every shape is fixed by the token count.
        self.is_decode = self.num_tokens > 0 and all(
            e - b <= 1 for b, e in zip(self.q_start, self.q_end, strict=True)
        )
        #: The bound decode steps size their compressed-row gathers by (see `Ds4CacheMetadata`).
        self.key_len_bound = static_seq_len or max(seq_lens, default=0)
        #: The request of each token, on the device the step's tensors index it with (the
        #: block table's: on CUDA, a CPU index into GPU rows failed); padding tokens get the
        #: null row after the requests' (`Ds4CacheMetadata.request_blocks`). From the device
        #: copy of the query starts when there is one: a search on the device, nothing copied in.
        if query_start_loc_device is not None:
            ends = query_start_loc_device[1:]
            tokens = torch.arange(self.num_tokens, device=ends.device, dtype=ends.dtype)
            self.token_req = torch.searchsorted(ends, tokens, right=True).to(device)
        else:
            counts = torch.tensor(
                [e - b for b, e in zip(self.q_start, self.q_end, strict=True)] + [self.padding_tokens]
            )
            self.token_req = torch.repeat_interleave(
                torch.arange(len(seq_lens) + 1), counts, output_size=self.num_tokens
            ).to(device)

    def closing_tokens(self, ratio: int) -> torch.Tensor | None:
        """Indices (in this step's tokens) of the tokens whose position p closes a window of
        ``ratio``, (p + 1) % ratio == 0, in order, on the plan's device; None if no token does.

        Known on the host from the plan, so nothing is read back from the device: one small copy
        in per ratio and step with a prefill (decode steps test each token on the device).
        """
        if ratio not in self._closing:
            out: list[int] = []
            for _, queries, first, seq_len in self.requests():
                p0 = first + (ratio - 1 - first) % ratio
                out += [queries.start + p - first for p in range(p0, seq_len, ratio)]
            self._closing[ratio] = (
                torch.tensor(out, dtype=torch.int64).to(self.token_req.device, non_blocking=True)
                if out
                else None
            )
        return self._closing[ratio]

    def requests(self):
        """(request index, query slice, first position, sequence length) per request with tokens this step."""
        for r, (b, e, p, n) in enumerate(
            zip(self.q_start, self.q_end, self.pos_start, self.seq_len, strict=True)
        ):
            if e > b:
                yield r, slice(b, e), p, n


class PagedState(nn.Module):
    """One role of the per-sequence state for one model layer.

    ``tokens_per_row`` is 1 for per-token rows (raw window, compressor inputs) and the compression
    ratio for compressed and indexer rows; row ``c`` of a compressed cache lives in the slot of
    token ``c * ratio``. Build one with the class methods, on the class the model is given (this
    one, or vLLM's `Ds4CacheLayer`).
    """

    def __init__(self, prefix: str, state: StateSpec) -> None:
        super().__init__()
        self.prefix = prefix
        self.state = state
        self.tokens_per_row = state.tokens_per_row
        self.kv_cache = torch.empty(0)

    @classmethod
    def raw_window(cls, prefix: str, width: int, window: int, dtype: torch.dtype) -> PagedState:
        return cls(prefix, StateSpec(RAW_WINDOW_BLOCK, width, dtype, window=window))

    @classmethod
    def compressed_rows(cls, prefix: str, width: int, ratio: int, dtype: torch.dtype) -> PagedState:
        return cls(prefix, StateSpec(COMPRESSED_BLOCK, width, dtype, tokens_per_row=ratio))

    @classmethod
    def compressor_inputs(
        cls, prefix: str, width: int, window: int, ratio: int, dtype: torch.dtype
    ) -> PagedState:
        return cls(prefix, StateSpec(STATE_BLOCK[ratio], width, dtype, window=window))

    def _slots(self, meta: Ds4CacheMetadata, req: torch.Tensor, token_pos: torch.Tensor):
        bs = meta.block_size
        table = meta.request_blocks
        # Clamped: vLLM leaves stale positions in a padded batch's padding tokens.
        index = (token_pos // bs).clamp(max=table.shape[1] - 1)
        blocks = table[req.to(table.device), index.to(table.device)].long()
        states = ((token_pos % bs) // self.tokens_per_row).to(blocks.device)
        return blocks, states

    def write(
        self, meta: Ds4CacheMetadata, req: torch.Tensor, token_pos: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Store ``rows[i]`` in the slot of token ``token_pos[i]`` of request ``req[i]``."""
        if rows.shape[0] == 0:
            return
        blocks, states = self._slots(meta, req, token_pos)
        self.kv_cache[blocks, 0, states] = rows.to(self.kv_cache.dtype)

    def write_where(
        self,
        meta: Ds4CacheMetadata,
        req: torch.Tensor,
        token_pos: torch.Tensor,
        rows: torch.Tensor,
        keep: torch.Tensor,
    ) -> None:
        """`write` of the rows where ``keep`` is true; the other slots keep what they hold. The
        same ops whatever ``keep`` says: nothing is asked of the device."""
        blocks, states = self._slots(meta, req, token_pos)
        old = self.kv_cache[blocks, 0, states]
        self.kv_cache[blocks, 0, states] = torch.where(keep[:, None], rows.to(old.dtype), old)

    def read(self, meta: Ds4CacheMetadata, req: torch.Tensor, token_pos: torch.Tensor) -> torch.Tensor:
        """Rows stored for tokens ``token_pos`` (any shape) of requests ``req`` (same shape)."""
        blocks, states = self._slots(meta, req, token_pos)
        return self.kv_cache[blocks, 0, states]
