"""Names that cross process or layer boundaries, defined once (imports nothing).

The API server, the scheduler-side connector, the worker and the model run in different
processes or layers and agree on these strings only by value: a key renamed on one side alone
would fail silently. Everyone imports them from here.
"""

from __future__ import annotations

# -- `kv_transfer_params` keys (API server <-> connector) -------------------------------------
#: The per-request secret seed of the tool-call ids this request's answer will carry.
TOOL_IDS_KEY = "ds4_tool_ids"
#: The history's tool-call id -> sampled DSML block, for the checkpoints' KTM trailers.
TOOL_MAP_KEY = "ds4_tool_map"
#: On a finished request's output: the prompt tokens the ds4disk connector loaded from disk.
DISK_TOKENS_PARAM = "ds4_disk_tokens"
#: Keys only the server sets; a client that sends one gets a 400.
RESERVED_TRANSFER_KEYS = (TOOL_IDS_KEY, TOOL_MAP_KEY, DISK_TOKENS_PARAM)

# -- forward context (model -> connector worker) ----------------------------------------------
#: Key of a step's `StepHidden` in the forward context's `additional_kwargs`.
STEP_HIDDEN_KEY = "ds4_step_hidden"

# -- the ds4 engine's special tokens ----------------------------------------------------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
#: The only strings the engine turns into special ids while tokenizing, in its match priority.
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML)
