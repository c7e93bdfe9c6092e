"""Puts checkpoint tensors into a `Ds4ForCausalLM`, whatever layout and weight format they come in.

Names go through `weight_names.model_name`. Projections (`QuantLinear`) and routed-expert
stacks (`QuantExpertWeight`) take their weights as the checkpoint stores them: float tensors in the
model's dtype, FP8 block-scaled and MXFP4 tensors paired with their `.scale` sibling and kept
packed, GGUF blocks (`QuantizedWeight`) as they are. Per-expert tensors fill their row of the
stack; transformers' fused `gate_up_proj` is split. Every error names the checkpoint tensor, and a
checkpoint that leaves a weight (or one expert of a stack) unset is refused with the first
missing name.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from ds4_vllm.model.parallel import Split
from ds4_vllm.model.quant import QuantizedWeight, QuantType
from ds4_vllm.model.quant.modules import QuantExpertWeight, QuantLinear
from ds4_vllm.model.weight_names import FUSED_GATE_UP, MTP_PATTERN, expert_slot, model_name

logger = logging.getLogger(__name__)

WeightValue = torch.Tensor | QuantizedWeight
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)


class CheckpointLoader:
    """One load of one model: tracks what was set so gaps are reported by name."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        self.stacks = {n: m for n, m in model.named_modules() if isinstance(m, QuantExpertWeight)}
        for module_name, holder in (*self.linears.items(), *self.stacks.items()):
            holder.name = module_name  # their errors then name the module
        holders = tuple(f"{n}." for n in (*self.linears, *self.stacks))
        tensors = [*model.named_parameters(), *model.named_buffers()]
        self.params: dict[str, torch.Tensor] = {n: t for n, t in tensors if not n.startswith(holders)}
        self.dtype = dtype  # float weights are stored in the model's dtype
        self.loaded: set[str] = set()
        # Quantized halves waiting for their other half: target -> {"weight"|"scale": (name, tensor)}.
        self.halves: dict[tuple[str, int | None], dict[str, tuple[str, torch.Tensor]]] = {}
        self.skipped_mtp = 0

    def load(self, weights: Iterable[tuple[str, WeightValue]]) -> set[str]:
        for name, value in weights:
            if MTP_PATTERN.match(name):
                self.skipped_mtp += 1
                continue
            self._load_one(name, model_name(name), value)
        if self.skipped_mtp:
            logger.info(
                "Skipped %d multi-token-prediction tensors (mtp.*): Ds4ForCausalLM has no MTP head",
                self.skipped_mtp,
            )
        self._check_complete()
        return self.loaded

    def _load_one(self, name: str, target: str, value: WeightValue) -> None:
        slot = expert_slot(target)
        if slot is not None:
            stacked, expert, kind = slot
            stack = self._holder(name, stacked, self.stacks)
            if not 0 <= expert < stack.n_experts:
                raise ValueError(
                    f"checkpoint tensor {name!r}: expert {expert} is outside 0..{stack.n_experts - 1}"
                )
            self._put(name, (stacked, expert), kind, value)
            return
        fused = FUSED_GATE_UP.match(target)
        if fused is not None:
            gate = self._holder(name, f"{fused[1]}.gate_proj", self.stacks)
            up = self._holder(name, f"{fused[1]}.up_proj", self.stacks)
            want = (gate.full_shape[0], gate.full_shape[1] + up.full_shape[1], gate.full_shape[2])
            if tuple(value.shape) != want:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, expected {want}"
                )
            gate_rows, up_rows = self._float(name, value).split([gate.full_shape[1], up.full_shape[1]], dim=1)
            self._install(name, gate, None, gate_rows)
            self._install(name, up, None, up_rows)
            return
        base, _, kind = target.rpartition(".")
        if base in self.linears and kind in ("weight", "scale"):
            self._put(name, (base, None), kind, value)
            return
        if target in self.stacks:  # a whole stack at once (GGUF, transformers' down_proj)
            if not isinstance(value, QuantizedWeight):
                value = self._float(name, value)  # in the model's dtype, not cast on every step
            self._install(name, self.stacks[target], None, value)
            return
        self._copy(name, target, value)

    def _put(self, name: str, key: tuple[str, int | None], kind: str, value: WeightValue) -> None:
        """Install a float or GGUF weight now; hold a quantized half until its sibling arrives."""
        holder = self.stacks[key[0]] if key[1] is not None else self.linears[key[0]]
        if isinstance(value, QuantizedWeight):
            self._install(name, holder, key[1], value)
        elif kind == "weight" and value.dtype.is_floating_point and value.dtype != torch.float8_e4m3fn:
            self._install(name, holder, key[1], self._float(name, value))
        else:
            halves = self.halves.setdefault(key, {})
            halves[kind] = (name, value)
            if len(halves) == 2:
                del self.halves[key]
                self._install(name, holder, key[1], self._paired(holder, key[1], halves))

    def _paired(
        self, holder: nn.Module, expert: int | None, halves: dict[str, tuple[str, torch.Tensor]]
    ) -> QuantizedWeight:
        """FP8 block-scaled or MXFP4 weight from its data and `.scale` tensors."""
        (wname, data), (sname, scale) = halves["weight"], halves["scale"]
        if scale.dtype not in _SCALE_DTYPES:
            raise ValueError(
                f"checkpoint tensor {sname!r} is {scale.dtype}; scales must be UE8M0 (F8_E8M0) bytes"
            )
        if data.dtype == torch.float8_e4m3fn:
            qtype = QuantType.FP8_BLOCK
        elif data.dtype in (torch.int8, torch.uint8):
            qtype = QuantType.MXFP4
        else:
            raise ValueError(
                f"checkpoint tensor {wname!r} has a .scale but dtype {data.dtype} (expected FP8 or FP4)"
            )
        shape = holder.full_shape[1:] if expert is not None else holder.full_shape
        try:
            return QuantizedWeight.from_buffer(qtype, shape, data, scale)
        except ValueError as err:
            raise ValueError(f"checkpoint tensor {wname!r}: {err}") from None

    def _install(self, name: str, holder: nn.Module, expert: int | None, value: WeightValue) -> None:
        try:
            if expert is None:
                holder.set_weight(value)
            else:
                holder.set_expert(expert, value)
        except (ValueError, TypeError, IndexError) as err:
            raise ValueError(f"checkpoint tensor {name!r}: {err}") from None

    def _float(self, name: str, tensor: WeightValue) -> torch.Tensor:
        if isinstance(tensor, QuantizedWeight) or not tensor.dtype.is_floating_point:
            raise ValueError(f"checkpoint tensor {name!r} must be a float tensor here, got {_kind(tensor)}")
        return tensor.to(self.dtype)

    def _holder(self, name: str, target: str, table: dict[str, nn.Module]) -> nn.Module:
        if target not in table:
            raise ValueError(
                f"checkpoint tensor {name!r} does not belong to Ds4ForCausalLM (mapped to {target!r})"
            )
        return table[target]

    def _copy(self, name: str, target: str, value: WeightValue) -> None:
        """A plain parameter or buffer (norms, hyper-connections, router, embedding, sinks)."""
        param = self._holder(name, target, self.params)
        if isinstance(value, QuantizedWeight):
            raise ValueError(
                f"checkpoint tensor {name!r} is {value.qtype.value}; {target!r} takes float values"
            )
        split: Split | None = getattr(param, "tp_split", None)
        want = tuple(param.shape) if split is None else split.whole_shape(tuple(param.shape))
        if tuple(value.shape) != want:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, expected {want}")
        if split is not None:  # this rank's rows of a tensor split across tensor-parallel ranks
            value = value.narrow(split.axis, split.part.start, len(split.part))
        if (
            value.dtype.is_floating_point != param.dtype.is_floating_point
            or value.dtype == torch.float8_e4m3fn
        ):
            raise ValueError(f"checkpoint tensor {name!r} is {value.dtype}; {target!r} is {param.dtype}")
        if (
            getattr(param, "keeps_checkpoint_dtype", False)
            and value.dtype.is_floating_point
            and value.element_size() <= param.element_size()
        ):
            # Kept as stored (the model converts what it reads): no copy of a memory-mapped table,
            # only this rank's part of one split across ranks.
            param.data = value.to(param.device) if split is None else value.to(param.device).clone()
        else:
            with torch.no_grad():
                param.copy_(value.to(param.dtype))
        self.loaded.add(target)

    def _check_complete(self) -> None:
        for (target, expert), halves in self.halves.items():
            (name, _), have = next(iter(halves.values())), next(iter(halves))
            other = "scale" if have == "weight" else "weight"
            where = f"{target}" if expert is None else f"{target} expert {expert}"
            raise ValueError(f"checkpoint tensor {name!r} ({where}) has no matching .{other} tensor")
        for target, stack in self.stacks.items():
            gap = stack.missing_experts()
            if gap:
                raise ValueError(f"checkpoint is missing expert {gap[0]} of {target!r} ({len(gap)} missing)")
            self.loaded.add(f"{target}.weight")
        for target, linear in self.linears.items():
            if not linear.is_loaded:
                raise ValueError(f"checkpoint is missing tensor {target + '.weight'!r}")
            self.loaded.add(f"{target}.weight")
        missing = sorted(n for n in self.params if n not in self.loaded and not n.endswith("inv_freq"))
        if missing:
            raise ValueError(f"checkpoint is missing tensor {missing[0]!r} ({len(missing)} missing in all)")


def _kind(value: WeightValue) -> str:
    return value.qtype.value if isinstance(value, QuantizedWeight) else str(value.dtype)
