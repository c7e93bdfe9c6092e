"""When to checkpoint: ds4's save points (spec §5.2) as pure functions of options and token counts.

ds4 has one live session; vLLM runs many requests at once. So instead of a session-wide
"last stored" counter, every function takes the request's own counts, and the connector
keeps one `last_stored` per request:

- `plan_prefill_saves` lists, before a request's prefill starts, the token positions where
  its state must be checkpointed (`cold`, `continued`). The connector ends a prefill chunk
  at each of them, because a DSV4 state can only be saved at the exact position it holds.
- `continued_due` is asked before each decode step.
- `finished_save` decides the `evict` save of a finished request (its full state, prompt +
  generated, before vLLM's memory may drop it) and the `shutdown` save of a request still
  in memory when the server stops gracefully.
- `answer_start_save` replaces it when the answer will not come back as it was generated
  (`answer_comes_back`: aborted; for a chat render, also cut inside its reasoning, which clients
  drop, stopped by a stop string, or bytes that are not UTF-8): the
  state where the answer starts, which the follow-up or the retry shares, instead of a
  state after the answer that no later prompt extends.

A request that reused tokens (from vLLM's memory or from disk) gets no cold save, exactly
as in ds4; its `last_stored` starts at the reused count.

Beyond ds4, `agent-system` saves (off with `--kv-cache-divergence-tokens 0`) for prompts that
share a long set-up (tools, system prompt) and part late in it (a folder's path):
- a prompt is also saved every `align` (2048) tokens of the set-up it did not reuse
  (`setup_ladder`), so the first prompt that parts from it reuses all but at most 2048 tokens
  of what they share;
- a prompt that parts from a known prompt past what it could reuse is saved where they part
  (`divergence_save`), so the next prompt sharing that prefix (an agent started in a third
  folder) reuses all of it but the line where they part.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Sequence

from ds4_vllm.kvc.constants import SaveReason

from .options import StoreOptions


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class SaveDecision:
    """Checkpoint the request's state when it holds exactly `tokens` tokens, for `reason`.

    `why` names the rule within the file's reason where one reason has several (the trace's
    "cold(anchor)", "agent-system(ladder)", "agent-system(divergence)", "evict(answer-start)");
    the file's header holds only `reason`.
    """

    tokens: int
    reason: SaveReason
    why: str = dataclasses.field(default="", compare=False)

    def __str__(self) -> str:
        why = f"({self.why})" if self.why else ""
        return f"{self.reason.label}{why}@{self.tokens}"


def store_len(options: StoreOptions, n: int) -> int:
    """ds4_kvstore_store_len: trim the tail, round down to the alignment, never below min.

    n <= min + trim, or a result below min, leaves n unchanged (2079 -> 2079, 2080 -> 2048
    with the defaults).
    """
    trim, align, lo = options.boundary_trim_tokens, options.boundary_align_tokens, options.min_tokens
    if n > lo + trim:
        s = n - trim
        if align > 0:
            s -= s % align
        if s >= lo:
            return s
    return n


def chat_anchor(tokens: Sequence[int], user_id: int, assistant_id: int) -> int:
    """Position of the last `<｜User｜>` before the first `<｜Assistant｜>`, or -1.

    A prefix ending there holds BOS + tools + system + earlier turns, which the next
    conversation with the same set-up shares.
    """
    anchor = -1
    for pos, tok in enumerate(tokens):
        if tok == assistant_id:
            break
        if tok == user_id:
            anchor = pos
    return anchor


def cold_store_len(
    options: StoreOptions, prompt_tokens: Sequence[int], user_token_id: int, assistant_token_id: int
) -> int | None:
    """Where a cold prompt (nothing reused) is saved, or None when it gets no cold save.

    Cold saves need min <= len <= cold_max (cold_max 0 = off). The chat anchor wins when it
    is >= min (not aligned); otherwise `store_len(len)`.
    """
    n = len(prompt_tokens)
    if options.cold_max_tokens <= 0 or not options.min_tokens <= n <= options.cold_max_tokens:
        return None
    anchor = chat_anchor(prompt_tokens, user_token_id, assistant_token_id)
    return anchor if anchor >= options.min_tokens else store_len(options, n)


def continued_due(options: StoreOptions, live_tokens: int, last_stored: int) -> bool:
    """ds4's continued rule: live >= min, live on a step multiple, and past the last store."""
    step = options.continued_step
    return (
        step > 0
        and live_tokens >= options.min_tokens
        and live_tokens % step == 0
        and live_tokens > last_stored
    )


def divergence_save(
    options: StoreOptions,
    prompt_tokens: Sequence[int],
    shared_tokens: int,
    cached_tokens: int,
    user_token_id: int,
    assistant_token_id: int,
) -> SaveDecision | None:
    """An `agent-system` save at `shared_tokens`, the prompt's tokens whose text a known
    checkpoint's text shares, when that lies inside the shared set-up (at or before the chat
    anchor: tools, system prompt, earlier turns) and at least `divergence_tokens` (512) past
    what this prompt reused. A later divergence (an answer re-rendered another way) is left to
    the conversation's own saves: no other prompt shares that prefix. Off with 0."""
    gain = options.divergence_tokens
    if gain <= 0 or shared_tokens < max(options.min_tokens, cached_tokens + gain):
        return None
    if shared_tokens > chat_anchor(prompt_tokens, user_token_id, assistant_token_id):
        return None
    return SaveDecision(shared_tokens, SaveReason.AGENT_SYSTEM, "divergence")


def setup_ladder(
    options: StoreOptions,
    prompt_tokens: Sequence[int],
    cached_tokens: int,
    user_token_id: int,
    assistant_token_id: int,
) -> list[SaveDecision]:
    """`agent-system` saves every `align` tokens of the part of a prompt's set-up (before its
    chat anchor) that it did not reuse, up to cold_max: a set-up seen for the first time (a new
    tool set, a new folder's system prompt). A later turn of a conversation, which reuses its
    whole set-up, gets none."""
    align = options.boundary_align_tokens
    if options.divergence_tokens <= 0 or align <= 0:
        return []
    anchor = chat_anchor(prompt_tokens, user_token_id, assistant_token_id)
    first = max(cached_tokens // align + 1, -(-options.min_tokens // align)) * align
    end = min(anchor, options.cold_max_tokens + 1)
    return [SaveDecision(m, SaveReason.AGENT_SYSTEM, "ladder") for m in range(first, end, align)]


def plan_prefill_saves(
    options: StoreOptions,
    prompt_tokens: Sequence[int],
    cached_tokens: int,
    user_token_id: int,
    assistant_token_id: int,
    shared_tokens: int = 0,
) -> list[SaveDecision]:
    """The positions at which a request's prefill must be checkpointed, in order.

    `cached_tokens` is what was reused (vLLM memory or disk); 0 means a cold prompt. Gives
    the cold point (cached == 0 and min <= len <= cold_max) and every continued step
    multiple m with cached < m <= len and m >= min. A cold point on a continued multiple is
    saved once, as cold (ds4 marks that frontier as already stored). The ladder over the
    set-up it did not reuse (`setup_ladder`) is added; `shared_tokens`: where the prompt parts
    from the known prompt it shares most with (`divergence_save`).
    """
    n = len(prompt_tokens)
    saves: dict[int, SaveDecision] = {}
    step = options.continued_step
    if step > 0:
        first = (cached_tokens // step + 1) * step
        for m in range(first, n + 1, step):
            if continued_due(options, m, cached_tokens):
                saves[m] = SaveDecision(m, SaveReason.CONTINUED)
    if cached_tokens == 0:
        cold = cold_store_len(options, prompt_tokens, user_token_id, assistant_token_id)
        if cold is not None and cold > 0:
            at_anchor = cold == chat_anchor(prompt_tokens, user_token_id, assistant_token_id)
            saves[cold] = SaveDecision(cold, SaveReason.COLD, "anchor" if at_anchor else "")
    for rung in setup_ladder(options, prompt_tokens, cached_tokens, user_token_id, assistant_token_id):
        saves.setdefault(rung.tokens, rung)
    parting = divergence_save(
        options, prompt_tokens, shared_tokens, cached_tokens, user_token_id, assistant_token_id
    )
    if parting is not None:
        saves.setdefault(parting.tokens, parting)
    return [saves[pos] for pos in sorted(saves)]


def finished_save(
    options: StoreOptions, total_tokens: int, last_stored: int, *, shutdown: bool = False
) -> SaveDecision | None:
    """The `evict` (or `shutdown`) save of a request's whole state, or None.

    ds4 saves the full live sequence, untrimmed, when it holds >= min tokens. We also skip it
    when a cold or continued save already stored exactly this length for the request.
    """
    if total_tokens < options.min_tokens or total_tokens <= last_stored:
        return None
    return SaveDecision(total_tokens, SaveReason.SHUTDOWN if shutdown else SaveReason.EVICT)


def answer_start(prompt_tokens: Sequence[int], assistant_token_id: int) -> int:
    """Where the answer's own text starts in every later rendering of this prompt: just after
    its final `<｜Assistant｜>` when that is among its last two tokens (a thinking tag may follow,
    and a later turn renders an earlier answer after `</think>` in either mode); else its length."""
    return _assistant_turn_start(prompt_tokens, assistant_token_id) or len(prompt_tokens)


def _assistant_turn_start(prompt_tokens: Sequence[int], assistant_token_id: int) -> int | None:
    n = len(prompt_tokens)
    for pos in range(n - 1, max(n - 3, -1), -1):
        if prompt_tokens[pos] == assistant_token_id:
            return pos + 1
    return None


class AnswerEnd(enum.Enum):
    """How a finished request's answer ended, as far as its client's next prompt is concerned."""

    ENDED = "ended"  # its own end of sentence or max_tokens: the client has all of it
    STOPPED = "stopped"  # a stop string or stop token (a chat client never sees that text)
    ABORTED = "aborted"  # a retry resends the prompt


def answer_comes_back(
    end: AnswerEnd,
    prompt_tokens: Sequence[int],
    answer: Sequence[int],
    answer_text: bytes,
    special: tuple[int, int, int],
) -> bool:
    """Will a follow-up extend this prompt with this answer's tokens? ``answer``: the generated
    ids, ``answer_text`` their bytes; ``special``: the `<｜Assistant｜>`, `<think>` and `</think>`
    ids. Not after an abort. For a chat render (a prompt ending in an assistant turn), whose
    client renders the answer's text again, not when a stop string or token ended it, when its
    reasoning is still open (clients drop unfinished reasoning), nor when its bytes are not
    UTF-8 (a client gets U+FFFD for the broken bytes and sends that back). A raw completion's or
    token ids' client appends what it got back itself, so only the abort rule applies there."""
    assistant_id, think_start_id, think_end_id = special
    if end is AnswerEnd.ABORTED:
        return False
    if _assistant_turn_start(prompt_tokens, assistant_id) is None:
        return True
    if end is AnswerEnd.STOPPED or reasoning_open(
        [*prompt_tokens[-1:], *answer], think_start_id, think_end_id
    ):
        return False
    try:
        answer_text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def reasoning_open(tokens: Sequence[int], think_start_id: int, think_end_id: int) -> bool:
    """True when the last thinking tag in `tokens` opens a block (an answer cut inside it)."""
    for tok in reversed(tokens):
        if tok == think_end_id:
            return False
        if tok == think_start_id:
            return True
    return False


def answer_start_save(
    options: StoreOptions, start: int, saved: Collection[int], *, shutdown: bool = False
) -> SaveDecision | None:
    """The save of a finished request whose answer will not come back as generated: its state
    at `start` (`answer_start`), unless shorter than min or already saved at that length."""
    if start < options.min_tokens or start in saved:
        return None
    return SaveDecision(start, SaveReason.SHUTDOWN if shutdown else SaveReason.EVICT, "answer-start")
