"""Copies checkpoint tensors into a `Ds4ForCausalLM`, whatever layout the checkpoint uses.

Names go through `weight_names.CHECKPOINT_MAPPER`; per-expert tensors are placed into their
row of the stacked expert parameters, and transformers' fused `gate_up_proj` is split. Every
error names the checkpoint tensor, and a checkpoint that leaves a parameter (or one expert of
a stack) unset is refused with the first missing name.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from ds4_vllm.model.weight_names import CHECKPOINT_MAPPER, FUSED_GATE_UP, MTP_PATTERN, expert_slot

logger = logging.getLogger(__name__)


class CheckpointLoader:
    """One load of one model: tracks what was set so gaps are reported by name."""

    def __init__(self, model: nn.Module) -> None:
        self.state: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.state.update(model.named_buffers())
        self.loaded: set[str] = set()
        self.experts_seen: dict[str, set[int]] = {}
        self.skipped_mtp = 0

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            if MTP_PATTERN.match(name):
                self.skipped_mtp += 1
                continue
            self._load_one(name, CHECKPOINT_MAPPER.map_name(name) or name, tensor)
        if self.skipped_mtp:
            logger.info(
                "Skipped %d multi-token-prediction tensors (mtp.*): Ds4ForCausalLM has no MTP head",
                self.skipped_mtp,
            )
        self._check_complete()
        return self.loaded

    def _load_one(self, name: str, target: str, tensor: torch.Tensor) -> None:
        slot = expert_slot(target)
        if slot is not None:
            stacked, expert, kind = slot
            if kind != "weight":
                raise ValueError(f"checkpoint tensor {name!r}: quantized experts are not supported here")
            param = self._param(name, stacked)
            if not 0 <= expert < param.shape[0]:
                raise ValueError(
                    f"checkpoint tensor {name!r}: expert {expert} is outside 0..{param.shape[0] - 1}"
                )
            self._copy(name, param[expert], tensor)
            self.experts_seen.setdefault(stacked, set()).add(expert)
            return
        fused = FUSED_GATE_UP.match(target)
        if fused is not None:
            gate = self._param(name, f"{fused[1]}.gate_proj")
            up = self._param(name, f"{fused[1]}.up_proj")
            want = (gate.shape[0], gate.shape[1] + up.shape[1], gate.shape[2])
            if tuple(tensor.shape) != want:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}"
                )
            gate_rows, up_rows = tensor.split([gate.shape[1], up.shape[1]], dim=1)
            self._copy(name, gate, gate_rows)
            self._copy(name, up, up_rows)
            self.loaded.update((f"{fused[1]}.gate_proj", f"{fused[1]}.up_proj"))
            return
        self._copy(name, self._param(name, target), tensor)
        self.loaded.add(target)

    def _param(self, name: str, target: str) -> torch.Tensor:
        if target not in self.state:
            raise ValueError(
                f"checkpoint tensor {name!r} does not belong to Ds4ForCausalLM (mapped to {target!r})"
            )
        return self.state[target]

    @staticmethod
    def _copy(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) or (
            tensor.dtype == torch.int8 and param.dtype.is_floating_point
        ):
            raise ValueError(
                f"checkpoint tensor {name!r} is quantized ({tensor.dtype}); this build loads float weights only"
            )
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))

    def _check_complete(self) -> None:
        for stacked, seen in self.experts_seen.items():
            total = self.state[stacked].shape[0]
            if len(seen) == total:
                self.loaded.add(stacked)
            else:
                gap = min(set(range(total)) - seen)
                raise ValueError(
                    f"checkpoint is missing expert {gap} of {stacked!r} ({total - len(seen)} missing)"
                )
        missing = sorted(n for n in self.state if n not in self.loaded and not n.endswith("inv_freq"))
        if missing:
            raise ValueError(f"checkpoint is missing tensor {missing[0]!r} ({len(missing)} missing in all)")
