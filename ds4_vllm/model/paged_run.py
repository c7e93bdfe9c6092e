"""Drive the model core over paged states without vLLM: what the GPU check and the model tests run.

`PagedRun` owns one set of caches for a model and a fixed block layout (request r owns blocks
``first_block + r * width ...`` of every group; block 0 stays vLLM's null block), and builds each
step's metadata the way vLLM's runner does: block tables and query starts on the model's device,
their host copies on the CPU, one metadata per group of equal states. With ``pad_to`` a decode
step is padded as vLLM pads a batch for a CUDA graph: padding requests with no tokens and
null-block rows, padding tokens after the last request's.
"""

from __future__ import annotations

import torch

from ds4_vllm.model.core import Ds4CausalLM
from ds4_vllm.model.paged_state import Ds4CacheMetadata, PagedState


class PagedRun:
    """Requests over paged states of one model: caches, block tables, and each step's metadata.

    ``static_seq_len``: decode steps gather compressed rows up to ``capacity`` tokens whatever
    the requests' lengths, as under vLLM's full CUDA graphs.
    """

    def __init__(
        self,
        model: Ds4CausalLM,
        capacity: int,
        requests: int,
        device: str | torch.device,
        first_block: int = 1,
        static_seq_len: bool = False,
    ) -> None:
        self.model, self.device, self.capacity = model, torch.device(device), capacity
        self.static_seq_len = capacity if static_seq_len else None
        self.states = [m for m in model.modules() if isinstance(m, PagedState)]
        self.groups: dict[str, list[PagedState]] = {}
        for state in self.states:
            self.groups.setdefault(repr(state.state), []).append(state)
        self.tables: dict[str, torch.Tensor] = {}
        for key, states in self.groups.items():
            spec = states[0].state
            width = -(-capacity // spec.block_size)
            blocks = first_block + requests * width
            for state in states:
                state.kv_cache = torch.zeros(
                    blocks,
                    1,
                    spec.block_size // spec.tokens_per_row,
                    spec.head_size,
                    dtype=spec.dtype,
                    device=self.device,
                )
            ids = first_block + torch.arange(requests * width, dtype=torch.int32).view(requests, width)
            self.tables[key] = ids.to(self.device)
        self.caches = {s.prefix: s.kv_cache for s in self.states}
        self.seq_lens = [0] * requests

    def block_ids(self, request: int) -> list[list[int]]:
        """The request's block ids per group, in the group order `role_of` numbers them."""
        return [self.tables[key][request].tolist() for key in self.groups]

    def role_of(self, name: str) -> tuple[int, int]:
        for group, (_key, states) in enumerate(self.groups.items()):
            if any(s.prefix == name for s in states):
                return group, states[0].state.block_size
        raise KeyError(name)

    def metadata(self, new_tokens: list[int], requests: list[int], pad_to: int | None = None) -> dict:
        """Each state's metadata for a step giving request ``requests[i]`` ``new_tokens[i]`` more
        tokens; ``pad_to`` pads the batch to that many requests and tokens (a decode step)."""
        starts = [0]
        for n in new_tokens:
            starts.append(starts[-1] + n)
        seq = [self.seq_lens[r] + n for r, n in zip(requests, new_tokens, strict=True)]
        padding = 0 if pad_to is None else pad_to - len(requests)
        starts += [starts[-1]] * padding
        seq += [0] * padding
        rows = torch.tensor(requests, device=self.device)
        metadata = {}
        for key, states in self.groups.items():
            table = self.tables[key].index_select(0, rows)
            if padding:
                table = torch.cat([table, table.new_zeros(padding, table.shape[1])])
            meta = Ds4CacheMetadata(
                block_table=table,
                block_size=states[0].state.block_size,
                query_start_loc=torch.tensor(starts),
                seq_lens=torch.tensor(seq),
                num_reqs=len(seq),
                query_start_loc_device=torch.tensor(starts, dtype=torch.int32, device=self.device),
                num_tokens=max(starts[-1], pad_to or 0),
                static_seq_len=self.static_seq_len,
            )
            metadata |= {s.prefix: meta for s in states}
        return metadata

    def bind(self) -> None:
        """Point the model's states at this run's caches (runs of one model take turns)."""
        for state in self.states:
            state.kv_cache = self.caches[state.prefix]

    def hidden(self, tokens: list[list[int]], requests: list[int], pad_to: int | None = None) -> torch.Tensor:
        """Run one step: ``tokens[i]`` are request ``requests[i]``'s new tokens (padding tokens,
        with ``pad_to``, are id 0 at position 0). The final hidden state of every token."""
        self.bind()
        metadata = self.metadata([len(t) for t in tokens], requests, pad_to)
        positions = [
            p
            for r, t in zip(requests, tokens, strict=True)
            for p in range(self.seq_lens[r], self.seq_lens[r] + len(t))
        ]
        ids = [t for ts in tokens for t in ts]
        padding = max(0, (pad_to or 0) - len(ids))
        ids_t = torch.tensor(ids + [0] * padding, device=self.device)
        positions_t = torch.tensor(positions + [0] * padding, device=self.device)
        with torch.no_grad():
            hidden = self.model.model(ids_t, positions_t, None, metadata)
        for r, t in zip(requests, tokens, strict=True):
            self.seq_lens[r] += len(t)
        return hidden

    def step(self, tokens: list[list[int]], requests: list[int], pad_to: int | None = None) -> torch.Tensor:
        """`hidden`, then float32 logits after each request's last token."""
        hidden = self.hidden(tokens, requests, pad_to)
        last = torch.tensor([len(t) for t in tokens], device=self.device).cumsum(0) - 1
        with torch.no_grad():
            return self.model.compute_logits(hidden[last]).float()


class StaticDecode:
    """Decode steps of up to ``batch`` requests of a `PagedRun` through fixed input buffers, as a
    CUDA graph replays them: token ids, positions, block tables and query starts are copied into
    the same tensors every step, and the step's shapes depend only on ``batch`` (the run must
    have ``static_seq_len``). On CUDA the step is captured once and replayed; elsewhere the same
    buffers feed an eager forward, so the CPU tests check what a replay would read.
    """

    def __init__(self, run: PagedRun, batch: int) -> None:
        if run.static_seq_len is None:
            raise ValueError("StaticDecode needs a PagedRun with static_seq_len=True")
        self.run, self.batch = run, batch
        device = run.device
        self.ids = torch.zeros(batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)
        self.query_starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.tables = {
            key: torch.zeros_like(table[:1]).expand(batch, -1).clone() for key, table in run.tables.items()
        }
        self.graph = None
        self.logits: torch.Tensor | None = None
        if device.type == "cuda":
            self._capture()

    def _forward(self) -> torch.Tensor:
        """One decode step over the buffers. Its metadata is made afresh, so the plan's device
        tensors (request of each token, null-block rows) are computed inside a captured graph."""
        metadata = {}
        for key, states in self.run.groups.items():
            meta = Ds4CacheMetadata(
                block_table=self.tables[key],
                block_size=states[0].state.block_size,
                query_start_loc=torch.arange(self.batch + 1),
                seq_lens=torch.full((self.batch,), self.run.capacity),
                num_reqs=self.batch,
                query_start_loc_device=self.query_starts,
                num_tokens=self.batch,
                static_seq_len=self.run.static_seq_len,
            )
            metadata |= {s.prefix: meta for s in states}
        with torch.no_grad():
            hidden = self.run.model.model(self.ids, self.positions, None, metadata)
            return self.run.model.compute_logits(hidden)

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as CUDA graphs need
            self.run.bind()
            self._forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()

    def load(self, tokens: list[int], requests: list[int]) -> None:
        """Copy one decode step's inputs into the buffers: a token for each of ``requests`` (at
        most ``batch``; the rest is padding, as vLLM pads: requests with no tokens, null-block
        rows, padding tokens at position 0)."""
        n = len(requests)
        if not 0 < n <= self.batch:
            raise ValueError(f"{n} requests for a decode step of at most {self.batch}")
        run, device = self.run, self.run.device
        self.ids.zero_()
        self.ids[:n] = torch.tensor(tokens, device=device)
        self.positions.zero_()
        self.positions[:n] = torch.tensor([run.seq_lens[r] for r in requests], device=device)
        self.query_starts.copy_(torch.arange(self.batch + 1, device=device).clamp(max=n))
        rows = torch.tensor(requests, device=device)
        for key, table in self.tables.items():
            table.zero_()
            table[:n] = run.tables[key].index_select(0, rows)

    def replay(self) -> torch.Tensor:
        """Run the step on what the buffers hold: [batch, vocab] logits, padding rows included."""
        self.run.bind()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._forward()
        return self.logits

    def step(self, tokens: list[int], requests: list[int]) -> torch.Tensor:
        """`load`, `replay`, and the requests one token longer: float32 logits per request."""
        self.load(tokens, requests)
        logits = self.replay()
        for r in requests:
            self.run.seq_lens[r] += 1
        return logits[: len(requests)].float().clone()
