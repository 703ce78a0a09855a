"""LoRA-wrapped projections (PEFT's ``get_peft_model``) sharded as their base layer.

A LoRA layer computes ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`` (per adapter). The plan gives its
base layer the style the unwrapped projection gets, and splits the adapter factor the base layer's split crosses:

- **column-wise base** (output features split; fused q/k/v and ``[gate | up]`` layouts alike): ``lora_B`` takes the
  base layer's style (its output rows are the base layer's rows, in the same order); ``lora_A`` stays whole
  (``replicate``): it reads the whole input, and every rank's slice of ``lora_B`` needs all ``r`` of its outputs.
  The input gradient through ``lora_B`` is summed over tp as the base layer's is, so ``lora_A``'s gradient is whole.
- **row-wise base** (input features split): ``lora_A`` takes the base layer's style (its input columns are the base
  layer's; its ``r`` outputs are summed over tp, or reduce-scattered on the sequence under sequence parallel);
  ``lora_B`` stays whole (``replicate``; ``sequence_parallel`` on the rank's slice of the sequence, its gradient
  summed over tp). The adapter's dropout then sees only this rank's input features: ``sharded_dropout`` draws the
  mask of the whole activation, as one process does, and applies this rank's slice.

Nothing else changes: parameter names (and so checkpoint keys) stay PEFT's, and ``merge_and_unload()`` adds
``B @ A`` to the base weight in its layout (a column-wise ``B`` times a whole ``A`` is split like a column-wise
base weight; a whole ``B`` times a row-wise ``A`` like a row-wise one). The plan lists the wrapped layers in
:attr:`~lightning_dist.parallel.tensor_parallel.plan.TensorParallelPlan.lora`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_dist.compat.peft import BASE_LAYER, LoraLinear, is_adapter_layer, lora_linear, why_adapter_is_whole
from lightning_dist.parallel.model_structure import join
from lightning_dist.parallel.tensor_parallel.plan import (
    COLUMN_STYLES,
    StyleSpec,
    TensorParallelPlan,
    TensorParallelPlanError,
    input_layout,
    shard_dim,
    style_name,
)

_OUTSIDE = (
    "a PEFT adapter layer outside the attention and MLP modules the plan shards (a wrapped output head or embedding"
    " is not sharded)"
)


def expand_lora(modules: dict[str, nn.Module], plan: TensorParallelPlan) -> None:
    """Replace each plan entry naming a LoRA-wrapped layer by entries for its base layer, adapters and dropout, and
    record every wrapped layer whose base layer the plan shards in ``plan.lora``."""
    styles: dict[str, StyleSpec] = {}
    for name, spec in plan.styles.items():
        lora = lora_linear(modules[name]) if name in modules else None
        if lora is None:
            styles[name] = spec
            continue
        styles.update(lora_styles(name, spec, lora, modules))
    plan.styles = styles
    for name, module in modules.items():
        lora = lora_linear(module)
        if lora is not None and join(name, lora.base) in styles:
            plan.lora[name] = style_name(styles[join(name, lora.base)])


def lora_styles(name: str, spec: StyleSpec, lora: LoraLinear, modules: dict[str, nn.Module]) -> dict[str, StyleSpec]:
    """The entries that shard the LoRA-wrapped layer ``name`` as its base layer with ``spec``."""
    style = style_name(spec)
    local = isinstance(spec, dict) and spec.get("use_local_output") is False
    if style not in (*COLUMN_STYLES, "rowwise") or local or style in COLUMN_STYLES and _sharded_input(spec):
        raise TensorParallelPlanError(
            f"plan[{name!r}] = {spec!r}: {name} is a LoRA-wrapped layer, sharded as its base layer for the styles"
            f" {[*COLUMN_STYLES, 'rowwise']} with whole inputs and local outputs only. Give its children"
            f" ({join(name, lora.base)}, lora_A.*, lora_B.*) styles of their own, or leave it out."
        )
    out: dict[str, StyleSpec] = {join(name, lora.base): spec}
    for lora_a, lora_b, dropout in lora.adapters:
        if style in COLUMN_STYLES:
            out[join(name, lora_a)] = "replicate"
            out[join(name, lora_b)] = copy.deepcopy(spec)
            continue
        out[join(name, lora_a)] = copy.deepcopy(spec)
        sequence = shard_dim(spec.get("output_layouts")) if isinstance(spec, dict) else None
        out[join(name, lora_b)] = (
            "replicate"
            if sequence is None
            else {"style": "sequence_parallel", "sequence_dim": sequence, "use_local_output": True}
        )
        features = _sharded_input(spec)
        drop = modules.get(join(name, dropout))
        if features is not None and type(drop) is nn.Dropout and drop.p > 0:
            out[join(name, dropout)] = {"style": "sharded_dropout", "input_layouts": f"shard({features})"}
    return out


def _sharded_input(spec: StyleSpec) -> int | None:
    """The dim a style's input arrives split on (a row-wise layer's default: the last), ``None`` when whole."""
    layout = input_layout(spec)
    if layout is None:
        return -1 if style_name(spec) == "rowwise" else None
    return shard_dim(layout)


def column_part_owner(name: str, lora: dict[str, str]) -> str | None:
    """The LoRA-wrapped layer whose output rows ``name`` holds (its base layer, or a ``lora_B`` under a column-wise
    base), so that it gets the same treatment as the wrapped layer would (``None`` otherwise)."""
    for owner, style in lora.items():
        if style in COLUMN_STYLES and name.startswith(f"{owner}."):
            part = name[len(owner) + 1 :]
            if part == BASE_LAYER or part.startswith("lora_B."):
                return owner
    return None


def adapters_left_whole(modules: dict[str, nn.Module], plan: TensorParallelPlan, claimed: list[str]) -> None:
    """Name in ``plan.unplanned`` every PEFT adapter layer the plan leaves whole that no other entry explains: one
    outside the attention and MLP modules (a LoRA-wrapped output head), or of a kind the plan cannot split."""
    for name, module in modules.items():
        if not is_adapter_layer(module) or name in plan.lora or name in plan.unplanned:
            continue
        if any(name.startswith(f"{c}.") for c in claimed if c):
            continue  # an attention or MLP left whole names its reason already
        plan.unplanned[name] = why_adapter_is_whole(module) or _OUTSIDE


class ShardedDropoutParallel(ParallelStyle):
    """An ``nn.Dropout`` whose input is this rank's slice (on ``dim``) of an activation split evenly over tp: it draws
    the mask of the whole activation, as one process would from the same random state, and applies this rank's
    slice. On CPU the result is bitwise one process's; every rank consumes the same random numbers as one process.

    The module's class becomes :class:`DropoutOfShard` (an ``nn.Dropout`` with the same state), as FSDP2 swaps the
    class of the modules it shards.
    """

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return shard_dropout(module, self.dim, device_mesh.size(), device_mesh.get_local_rank())


def shard_dropout(module: nn.Module, dim: int, shards: int, index: int) -> DropoutOfShard:
    """Make the ``nn.Dropout`` ``module`` (in place) the dropout of slice ``index`` of ``shards`` on ``dim``."""
    if type(module) is not nn.Dropout:
        raise TypeError(f"sharded_dropout applies to an nn.Dropout, not {type(module).__name__}")
    module.__class__ = DropoutOfShard
    assert isinstance(module, DropoutOfShard)
    module.shard_dim, module.shards, module.shard_index = dim, shards, index
    return module


class DropoutOfShard(nn.Dropout):
    """``nn.Dropout`` on one of ``shards`` equal slices (on ``shard_dim``) of an activation: see
    :class:`ShardedDropoutParallel`."""

    shard_dim: int
    shards: int
    shard_index: int

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0 or isinstance(x, DTensor):
            return super().forward(x)
        shape = list(x.shape)
        width = shape[self.shard_dim]
        shape[self.shard_dim] = width * self.shards
        noise = F.dropout(x.new_ones(shape), self.p, training=True)  # the whole mask, scaled by 1 / (1 - p)
        return x * noise.narrow(self.shard_dim, self.shard_index * width, width)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, slice {self.shard_index} of {self.shards} on dim {self.shard_dim}"


def sharded_dropout_style(options: dict[str, Any]) -> ShardedDropoutParallel:
    """The style of a ``sharded_dropout`` plan entry."""
    layout = options.get("input_layouts", "shard(-1)")
    dim = shard_dim(layout)
    if dim is None:
        raise TensorParallelPlanError(f"sharded_dropout: input_layouts must be 'shard(<dim>)', not {layout!r}")
    return ShardedDropoutParallel(dim)
