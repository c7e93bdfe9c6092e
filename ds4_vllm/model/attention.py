"""DeepSeek V4 attention over vLLM's paged state: sliding window, KV compressors, lightning indexer.

Per layer and step, writes come before reads: the step's raw rows and compressor
inputs are stored first, then every token that closes a window emits its
compressed row, and only then do queries gather their keys. So a chunk sees its
own tokens exactly as a single full prefill would.

With `Ds4Config.official_numerics` on, rows take the official graph's quantization round trips
(`qat.py`) before they are cached, and indexer queries before they are scored: the FP8 round
trip on main KV rows (raw and compressed), Hadamard + FP4 on indexer queries and indexer rows.
Cached indexer rows are then in the rotated basis, as in ds4's own cache. Off, none of this
code runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from ds4_vllm.model.layers import RMSNorm, rms_norm, split_parameter
from ds4_vllm.model.paged_state import BatchPlan, Ds4CacheMetadata, PagedState
from ds4_vllm.model.parallel import SINGLE, Split, TpGroup
from ds4_vllm.model.qat import fp8_kv_roundtrip, indexer_qat
from ds4_vllm.model.quant.modules import QuantLinear
from ds4_vllm.model.rope import TailRope

NEG_INF = float("-inf")
QUERY_BLOCK = 128  # queries attended together; bounds memory for long prefills
PICKED_BLOCK = 64  # queries whose indexer-picked rows are gathered at once (ratio-4 layers)
TIE_CHECK_QUERIES = 64  # above this many queries, top-k ties are looked for before they are redone


class Compressor(nn.Module):
    """Gated softmax pooling of ``ratio`` tokens into one row (ratio 4: overlapping lanes a/b).

    The per-token inputs ``[kv | gate + position_bias]`` are cached for the last
    ``coff * ratio`` tokens; the row for window ``c`` is pooled when token
    ``ratio * c + ratio - 1`` is processed and stored in the slot of token ``ratio * c``.
    ``finish_row`` (official numerics) maps each pooled, normed, rotated row to what is cached.
    """

    def __init__(
        self,
        hidden: int,
        width: int,
        ratio: int,
        rope: TailRope,
        eps: float,
        prefix: str,
        dtype,
        finish_row: Callable[[torch.Tensor], torch.Tensor] | None = None,
        states: type[PagedState] = PagedState,
    ) -> None:
        super().__init__()
        self.width, self.ratio, self.rope = width, ratio, rope
        self.finish_row = finish_row
        self.coff = 2 if ratio == 4 else 1
        self.kv_proj = QuantLinear(hidden, self.coff * width)
        self.gate_proj = QuantLinear(hidden, self.coff * width)
        self.position_bias = nn.Parameter(torch.zeros(ratio, self.coff * width))
        self.kv_norm = RMSNorm(width, eps)
        self.window = self.coff * ratio
        self.state_cache = states.compressor_inputs(
            f"{prefix}.state_cache", 2 * self.coff * width, self.window, ratio, dtype
        )
        self.kv_cache = states.compressed_rows(f"{prefix}.kv_cache", width, ratio, dtype)

    def update(self, y: torch.Tensor, positions: torch.Tensor, plan: BatchPlan, metadata: dict) -> None:
        state_meta: Ds4CacheMetadata = metadata[self.state_cache.prefix]
        kv = self.kv_proj(y)
        gate = self.gate_proj(y) + self.position_bias[positions % self.ratio]
        self.state_cache.write(state_meta, plan.token_req, positions, torch.cat([kv, gate], dim=-1))

        if plan.is_decode:
            # Every token pools a row and only those closing a window keep it: the same work and
            # shapes every step, whichever positions close a window (a replayed CUDA graph).
            closes = (positions + 1) % self.ratio == 0
            self._pool(y, positions, plan.token_req, metadata, closes)
            return
        closing = plan.closing_tokens(self.ratio)
        if closing is not None:
            self._pool(y, positions[closing], plan.token_req[closing], metadata)

    def _pool(
        self,
        y: torch.Tensor,
        last: torch.Tensor,
        req: torch.Tensor,
        metadata: dict,
        keep: torch.Tensor | None = None,
    ) -> None:
        """Pool the window ending at each position ``last`` of request ``req`` into its compressed
        row; with ``keep``, only the rows where it is true are stored."""
        state_meta: Ds4CacheMetadata = metadata[self.state_cache.prefix]
        offsets = torch.arange(self.window, device=last.device) - self.window + 1
        window_pos = last[:, None] + offsets[None, :]
        rows = self.state_cache.read(state_meta, req[:, None].expand_as(window_pos), window_pos.clamp(min=0))
        rows = rows.float()
        d, r = self.width, self.ratio
        if self.coff == 1:
            kv_rows, score_rows = rows[..., :d], rows[..., d : 2 * d]
        else:
            # Previous window contributes lane a, the current window lane b.
            kv_rows = torch.cat([rows[:, :r, :d], rows[:, r:, d : 2 * d]], dim=1)
            score_rows = torch.cat([rows[:, :r, 2 * d : 3 * d], rows[:, r:, 3 * d : 4 * d]], dim=1)
        score_rows = score_rows.masked_fill((window_pos < 0)[..., None], NEG_INF)
        kv_rows = kv_rows.masked_fill((window_pos < 0)[..., None], 0.0)
        pooled = (kv_rows * score_rows.softmax(dim=1)).sum(dim=1).to(y.dtype)
        first = last + 1 - r
        compressed = self.rope(self.kv_norm(pooled), first)
        if self.finish_row is not None:
            compressed = self.finish_row(compressed)
        if keep is None:
            self.kv_cache.write(metadata[self.kv_cache.prefix], req, first, compressed)
        else:
            self.kv_cache.write_where(
                metadata[self.kv_cache.prefix], req, first.clamp(min=0), compressed, keep
            )

    def rows(self, metadata: dict, request: int, count: int, device) -> torch.Tensor:
        """Compressed rows 0..count-1 of one request."""
        starts = torch.arange(count, device=device) * self.ratio
        req = torch.full_like(starts, request)
        return self.kv_cache.read(metadata[self.kv_cache.prefix], req, starts)


class Indexer(nn.Module):
    """Lightning indexer: scores compressed rows per query and keeps the top ``index_topk``."""

    def __init__(
        self, config, rope: TailRope, prefix: str, dtype, states: type[PagedState] = PagedState
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = (
            config.index_n_heads,
            config.index_head_dim,
            config.index_topk,
        )
        self.rope = rope
        self.official_numerics = config.official_numerics
        # Same construction as the ratio-4 compressor, narrower rows.
        self.compressor = Compressor(
            config.hidden_size,
            self.head_dim,
            4,
            rope,
            config.rms_norm_eps,
            prefix,
            dtype,
            finish_row=indexer_qat if self.official_numerics else None,
            states=states,
        )
        self.q_b_proj = QuantLinear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.scorer = nn.Module()
        self.scorer.weights_proj = QuantLinear(config.hidden_size, self.n_heads)

    def select(
        self,
        q_res: torch.Tensor,
        y: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [queries, k], valid [queries, k]): the compressed rows each query attends to.

        ``keys`` are this request's indexer rows 0..count-1 (float32, [count, d]), read once per
        step, or each query's own ([queries, count, d], a decode step of several requests).
        """
        count = keys.shape[-2]
        q = self.q_b_proj(q_res).view(-1, self.n_heads, self.head_dim)
        q = self.rope(q, positions)
        if self.official_numerics:
            q = indexer_qat(q)
        q = q.float()
        # [t, h, c] scores, then the weighted sum over heads as one batched matmul: in place, so
        # the largest tensor of a long prefill is written once and read twice.
        pattern = "thd,cd->thc" if keys.dim() == 2 else "thd,tcd->thc"
        scores = torch.einsum(pattern, q, keys).relu_().mul_(self.head_dim**-0.5)
        weights = self.scorer.weights_proj(y).float() * self.n_heads**-0.5
        scores = torch.bmm(weights.unsqueeze(1), scores).squeeze(1)
        visible = torch.arange(count, device=y.device)[None, :] < ((positions + 1) // 4)[:, None]
        return select_top_rows(scores, visible, self.topk)


def select_top_rows(
    scores: torch.Tensor, visible: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [queries, k], valid [queries, k]): the ``topk`` best-scoring visible rows of each query.

    With fewer than ``topk`` rows, every row is listed and ``valid`` is ``visible``. Ties go to
    earlier rows, as in ds4's selection loop (strict ``>`` scanning rows in order), so the choice
    does not depend on how vLLM chunks a prefill: torch.topk picks the set, and only queries
    whose k-th best score is tied with an unpicked row are redone by row order.
    """
    n_queries, count = scores.shape
    if count <= topk:
        rows = torch.arange(count, device=scores.device).expand(n_queries, count)
        return rows, visible
    scores = scores.masked_fill(~visible, NEG_INF)
    best, indices = scores.topk(topk, dim=-1)
    kth = best[:, -1:]
    # A query whose k-th score is -inf sees fewer than topk rows: all of them are picked.
    tied = (kth[:, 0] > NEG_INF) & ((scores == kth).sum(-1) > (best == kth).sum(-1))
    # A decode step redoes every query without asking the device whether any is tied (a host
    # read would stall a GPU); a long prefill asks first, since redoing costs a second top-k.
    if n_queries > TIE_CHECK_QUERIES and not bool(tied.any()):
        return indices, best > NEG_INF
    above = scores > kth
    ties = scores == kth
    need = topk - above.sum(-1, keepdim=True)
    chosen = above | (ties & (ties.cumsum(-1) <= need))
    # The chosen rows in row order: the largest keys are the earliest chosen rows.
    first_rows = torch.arange(count, 0, -1, device=scores.device)
    in_row_order = (chosen * first_rows).topk(topk, dim=-1).indices
    return torch.where(tied[:, None], in_row_order, indices), best > NEG_INF


class Ds4Attention(nn.Module):
    """Shared-KV MQA with per-head sinks over the raw window plus compressed rows."""

    def __init__(
        self,
        config,
        layer_idx: int,
        prefix: str,
        dtype,
        tp: TpGroup = SINGLE,
        states: type[PagedState] = PagedState,
    ) -> None:
        super().__init__()
        hidden, self.head_dim = config.hidden_size, config.head_dim
        self.tp = tp
        # Tensor parallel: each rank has whole output groups and the query heads feeding them.
        groups = tp.part(config.o_groups, "the number of output groups (o_groups)")
        heads_per_group = config.num_attention_heads // config.o_groups
        heads = range(groups.start * heads_per_group, groups.stop * heads_per_group)
        self.n_heads, self.o_groups = len(heads), len(groups)
        self.eps = config.rms_norm_eps
        self.window = config.sliding_window
        self.ratio = config.compress_ratios[layer_idx]
        rope_dim = config.rope_dim
        # Official numerics: main KV rows are cached after an FP8 round trip of their no-RoPE dims.
        self.finish_kv = partial(fp8_kv_roundtrip, rope_dim=rope_dim) if config.official_numerics else None
        rope_label = "main" if self.ratio == 0 else "compress"
        self.rope = TailRope(config.rope_parameters[rope_label], rope_dim)

        self.q_a_proj = QuantLinear(hidden, config.q_lora_rank)
        self.q_a_norm = RMSNorm(config.q_lora_rank, self.eps)
        split = tp.size > 1
        hd, o_lora = self.head_dim, config.o_lora_rank
        q_rows = (
            Split(0, range(heads.start * hd, heads.stop * hd), config.num_attention_heads * hd)
            if split
            else None
        )
        o_rows = (
            Split(0, range(groups.start * o_lora, groups.stop * o_lora), config.o_groups * o_lora)
            if split
            else None
        )
        o_cols = Split(1, o_rows.part, o_rows.total) if split else None
        self.q_b_proj = QuantLinear(config.q_lora_rank, config.num_attention_heads * hd, q_rows)
        self.kv_proj = QuantLinear(hidden, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        in_per_group = heads_per_group * hd
        self.o_a_proj = QuantLinear(in_per_group, config.o_groups * o_lora, o_rows)
        self.o_b_proj = QuantLinear(config.o_groups * o_lora, hidden, o_cols)
        self.sinks = split_parameter(
            nn.Parameter(torch.zeros(self.n_heads)),
            Split(0, heads, config.num_attention_heads) if split else None,
        )

        #: `attend` as an op opaque to torch.compile (`ds4_vllm.model.step_ops`); None: called directly.
        self.step_attention: Callable[..., torch.Tensor] | None = None
        self.swa_cache = states.raw_window(f"{prefix}.swa_cache", self.head_dim, self.window, dtype)
        self.compressor: Compressor | None = None
        if self.ratio:
            self.compressor = Compressor(
                hidden,
                self.head_dim,
                self.ratio,
                self.rope,
                self.eps,
                f"{prefix}.compressor",
                dtype,
                finish_row=self.finish_kv,
                states=states,
            )
            if self.ratio == 4:
                self.compressor.indexer = Indexer(
                    config, self.rope, f"{prefix}.compressor.indexer", dtype, states
                )

    def forward(self, y: torch.Tensor, positions: torch.Tensor, metadata: dict | None) -> torch.Tensor:
        q_res = self.q_a_norm(self.q_a_proj(y))
        kv = self.rope(self.kv_norm(self.kv_proj(y)), positions)
        if self.step_attention is not None:
            z = self.step_attention(q_res, kv, y, positions)
        else:
            z = self.attend(q_res, kv, y, positions, metadata)
        return self.tp.all_reduce(self.o_b_proj(z))

    def queries(self, q_res: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[t, heads, head_dim]: the normed, rotated queries of ``t`` tokens."""
        q = rms_norm(self.q_b_proj(q_res).view(q_res.shape[0], self.n_heads, self.head_dim), self.eps)
        return self.rope(q, positions)

    def output_groups(self, out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[t, o_groups * o_lora_rank]: attention outputs rotated back, each group projected."""
        n = out.shape[0]
        out = self.rope(out, positions, inverse=True)
        return self.o_a_proj.grouped(out.reshape(n, self.o_groups, -1)).reshape(n, -1)

    def attend(self, q_res, kv, y, positions, metadata: dict | None) -> torch.Tensor:
        """Store the step's rows in the caches, then attend: the per-step, data-dependent part.

        Returns the grouped output projection's result. A prefill makes its queries and outputs
        one block of ``QUERY_BLOCK`` queries at a time: a 2,048-token chunk's queries at real
        widths are 256 MiB in float32, as is its attention output, and neither is ever whole.
        """
        n = q_res.shape[0]
        if metadata is None:
            # Profiling / warm-up run: no cache is bound, no state to read or write.
            return q_res.new_zeros(n, self.o_a_proj.out_features)
        swa_meta: Ds4CacheMetadata = metadata[self.swa_cache.prefix]
        plan = swa_meta.plan
        if self.finish_kv is not None:  # here, not in the compiled graph: exact FP8 rounding
            kv = self.finish_kv(kv)
        self.swa_cache.write(swa_meta, plan.token_req, positions, kv)
        if self.compressor is not None:
            self.compressor.update(y, positions, plan, metadata)
            if self.ratio == 4:
                self.compressor.indexer.compressor.update(y, positions, plan, metadata)

        if plan.is_decode:
            q = self.queries(q_res, positions)
            out = self._attend_decode(q, q_res, y, positions, swa_meta, metadata, plan)
            return self.output_groups(out, positions)
        z = q_res.new_empty(n, self.o_a_proj.out_features)
        for request, queries, first_pos, seq_len in plan.requests():
            # Compressed rows (and indexer rows) are read once per request and step, not per block.
            comp_keys = index_keys = None
            if self.compressor is not None and seq_len // self.ratio:
                comp_keys = self.compressor.rows(metadata, request, seq_len // self.ratio, y.device).float()
                if self.ratio == 4:
                    indexer = self.compressor.indexer
                    index_keys = indexer.compressor.rows(metadata, request, seq_len // 4, y.device).float()
            # Query blocks bound the work and memory to block x (window + compressed rows).
            for start in range(queries.start, queries.stop, QUERY_BLOCK):
                block = slice(start, min(start + QUERY_BLOCK, queries.stop))
                block_first = first_pos + (start - queries.start)
                block_end = block_first + (block.stop - block.start)
                out = self._attend_block(
                    self.queries(q_res[block], positions[block]),
                    q_res[block],
                    y[block],
                    positions[block],
                    request,
                    block_first,
                    block_end,
                    swa_meta,
                    comp_keys,
                    index_keys,
                )
                z[block] = self.output_groups(out, positions[block])
        return z

    def _attend_decode(
        self, q, q_res, y, positions, swa_meta, metadata: dict, plan: BatchPlan
    ) -> torch.Tensor:
        """A step where every request has one query: all requests at once, no loop over them.

        Each query's keys are its raw window (``window`` rows ending at its position; rows before
        position 0 are masked) and its compressed rows: on ratio-128 layers rows 0..n-1 of the
        longest request in the step (rows past a request's own count are masked and zeroed:
        they may hold anything), on ratio-4 layers only the rows its indexer picks. The host
        knows the step's shapes from the plan; the device is never asked for a value.
        """
        n = q.shape[0]
        req = plan.token_req
        key_pos = positions[:, None] + torch.arange(1 - self.window, 1, device=q.device)[None, :]
        in_window = key_pos >= 0
        keys = self.swa_cache.read(swa_meta, req[:, None].expand_as(key_pos), key_pos.clamp(min=0)).float()
        qf = q.float()
        scale = self.head_dim**-0.5
        logits = torch.einsum("thd,tkd->thk", qf, keys) * scale
        logits = logits.masked_fill(~in_window[:, None, :], NEG_INF)
        count = plan.key_len_bound // self.ratio if self.compressor is not None else 0
        comp = None
        if count:
            visible = torch.arange(count, device=q.device)[None, :] < ((positions + 1) // self.ratio)[:, None]
            rows_req = req[:, None].expand(n, count)
            starts = (torch.arange(count, device=q.device) * self.ratio)[None, :].expand(n, count)
            if self.ratio == 4:
                indexer = self.compressor.indexer
                index_meta = metadata[indexer.compressor.kv_cache.prefix]
                index_keys = indexer.compressor.kv_cache.read(index_meta, rows_req, starts).float()
                index_keys = index_keys.masked_fill(~visible[..., None], 0.0)
                indices, visible = indexer.select(q_res, y, positions, index_keys)
                rows_req, starts = req[:, None].expand_as(indices), indices * self.ratio
            comp_meta = metadata[self.compressor.kv_cache.prefix]
            comp = self.compressor.kv_cache.read(comp_meta, rows_req, starts).float()
            comp = comp.masked_fill(~visible[..., None], 0.0)
            comp_logits = torch.einsum("thd,tkd->thk", qf, comp) * scale
            logits = torch.cat([logits, comp_logits.masked_fill(~visible[:, None, :], NEG_INF)], dim=-1)
        sinks = self.sinks.float().view(1, -1, 1).expand(n, -1, 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)
        out = torch.einsum("thk,tkd->thd", probs[..., : self.window], keys)
        if comp is not None:
            out = out + torch.einsum("thk,tkd->thd", probs[..., self.window : -1], comp)
        return out.to(q.dtype)

    def _attend_block(
        self, q, q_res, y, q_pos, request, first_pos, end_pos, swa_meta, comp_keys, index_keys
    ) -> torch.Tensor:
        """Attention of queries at positions [first_pos, end_pos) of one request.

        Keys: the raw window (masked per query), then either every compressed row visible to
        the block (ratio 128) or, on ratio-4 layers, the rows the indexer picked for each query,
        gathered per query so that the work per query is bounded by ``index_topk``.
        """
        key_start = max(0, first_pos - self.window + 1)
        key_pos = torch.arange(key_start, end_pos, device=q.device)
        keys = self.swa_cache.read(swa_meta, torch.full_like(key_pos, request), key_pos).float()
        rel = q_pos[:, None] - key_pos[None, :]
        mask = (rel >= 0) & (rel < self.window)
        qf = q.float()
        scale = self.head_dim**-0.5
        logits = torch.einsum("thd,kd->thk", qf, keys) * scale
        logits = logits.masked_fill(~mask[:, None, :], NEG_INF)
        count = end_pos // self.ratio if self.compressor is not None else 0
        picked = None
        if count and self.ratio == 4:
            indices, valid = self.compressor.indexer.select(q_res, y, q_pos, index_keys[:count])
            # Each query's picked rows [t, k, d] are gathered PICKED_BLOCK queries at a time, once
            # for the logits and again for the output (512 queries' at real widths: 512 MiB).
            picked = indices.split(PICKED_BLOCK)
            comp_logits = (
                torch.cat(
                    [
                        torch.einsum("thd,tkd->thk", qb, comp_keys[ib])
                        for qb, ib in zip(qf.split(PICKED_BLOCK), picked, strict=True)
                    ]
                )
                * scale
            )
            logits = torch.cat([logits, comp_logits.masked_fill(~valid[:, None, :], NEG_INF)], dim=-1)
        elif count:
            comp = comp_keys[:count]
            comp_mask = torch.arange(count, device=q.device)[None, :] < ((q_pos + 1) // self.ratio)[:, None]
            comp_logits = torch.einsum("thd,kd->thk", qf, comp) * scale
            logits = torch.cat([logits, comp_logits.masked_fill(~comp_mask[:, None, :], NEG_INF)], dim=-1)
        sinks = self.sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)
        window_keys = keys.shape[0]
        out = torch.einsum("thk,kd->thd", probs[..., :window_keys], keys)
        if picked is not None:
            comp_probs = probs[..., window_keys:-1].split(PICKED_BLOCK)
            out = out + torch.cat(
                [
                    torch.einsum("thk,tkd->thd", pb, comp_keys[ib])
                    for pb, ib in zip(comp_probs, picked, strict=True)
                ]
            )
        elif count:
            out = out + torch.einsum("thk,kd->thd", probs[..., window_keys:-1], comp)
        return out.to(q.dtype)
