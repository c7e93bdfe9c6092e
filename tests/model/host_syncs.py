"""Count, on a CPU run, the calls of the model that would stall a GPU: host reads of device values.

On a GPU, `.tolist()`, `.item()`, `bool(t)`, `.cpu()`, `.numpy()` of a device tensor, and ops
whose output shape depends on values (`nonzero`, `bincount`, `masked_select`, `unique`,
`repeat_interleave` without `output_size`) wait for the device; `torch.tensor` / `torch.as_tensor`
of Python data makes a host tensor that the step then copies to the device. On a CPU nothing
waits, so these calls are counted by a `TorchFunctionMode` instead, each with its call site in
`ds4_vllm`. Tensors that live on the host in vLLM's metadata too (`query_start_loc_cpu`) are
passed as `host` and not counted; or, for a model on another device (`meta`), only reads of that
device's tensors count.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}
_VALUE_SHAPED = {
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.argwhere,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.unique,
    torch.Tensor.unique,
    torch.bincount,
    torch.Tensor.bincount,
}
_HOST_MADE = {torch.tensor, torch.as_tensor}
_PACKAGE = "/ds4_vllm/"


def _site() -> str:
    """file:line of the innermost caller inside the ds4_vllm package."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if _PACKAGE in name:
            return f"{name[name.rindex(_PACKAGE) + 1 :]}:{frame.f_lineno}"
        frame = frame.f_back
    return "<outside ds4_vllm>"


class HostSyncCounter(TorchFunctionMode):
    """Records each would-be GPU sync as (kind, call site); `counts` sums them per site."""

    def __init__(self, host: Iterable[torch.Tensor] = (), device: str | None = None) -> None:
        super().__init__()
        self.host = {t.untyped_storage().data_ptr() for t in host}
        self.device = device
        self.events: list[tuple[str, str]] = []

    def _on_device(self, value: object) -> bool:
        """A tensor the step keeps on its device: with ``device``, any tensor there; else any
        tensor but the ``host`` ones."""
        if not isinstance(value, torch.Tensor):
            return False
        if self.device is not None:
            return value.device.type == self.device
        return value.untyped_storage().data_ptr() not in self.host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS and args and self._on_device(args[0]):
            self.events.append((f"read ({func.__name__})", _site()))
        elif func in _VALUE_SHAPED and args and self._on_device(args[0]):
            self.events.append((f"value-shaped ({func.__name__})", _site()))
        elif func is torch.repeat_interleave and kwargs.get("output_size") is None and len(args) > 1:
            self.events.append(("value-shaped (repeat_interleave)", _site()))
        elif func in _HOST_MADE and args and not isinstance(args[0], torch.Tensor):
            self.events.append((f"host-made ({func.__name__})", _site()))
        return func(*args, **kwargs)

    @property
    def counts(self) -> dict[tuple[str, str], int]:
        return dict(collections.Counter(self.events))
