"""Applying a tensor-parallel plan (see :mod:`lightning_dist.parallel.tensor_parallel.plan`) to a model.

``apply_tensor_parallel(model, tp_mesh, plan)`` turns each style into a ``torch.distributed.tensor.parallel`` style
(plus two small ones of ours), parallelizes the modules, and sets head-count attributes of attention modules to the
per-rank count so code that reshapes with ``self.n_head`` stays correct. Apply it before FSDP2.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_dist.parallel.dtensor_checks import register_truth_test_sharding
from lightning_dist.parallel.model_structure import KV_HEAD_ATTRIBUTES, is_conv1d
from lightning_dist.parallel.tensor_parallel.fused import (
    Conv1DParallel,
    FusedColwiseParallel,
    FusedGateUpParallel,
    layout_from_spec,
)
from lightning_dist.parallel.tensor_parallel.hugging_face import MODEL_PLAN, shipped_plan
from lightning_dist.parallel.tensor_parallel.inference import infer_plan, resolve_explicit_plan
from lightning_dist.parallel.tensor_parallel.kv_heads import ReplicatedKVHeadParallel
from lightning_dist.parallel.tensor_parallel.lora import column_part_owner, sharded_dropout_style
from lightning_dist.parallel.tensor_parallel.multihead import MultiheadAttentionParallel
from lightning_dist.parallel.tensor_parallel.partial_gradients import mark_partial_over_tp
from lightning_dist.parallel.tensor_parallel.plan import (
    TensorParallelPlan,
    TensorParallelPlanError,
    normalize_style,
    style_name,
)

__all__ = [
    "apply_tensor_parallel",
    "build_style",
    "parse_layout",
    "resolve_plan",
    "set_count",
    "shard_gradients_like_parameters",
    "tp_sharded_parameters",
]

_LAYOUT = re.compile(r"^\s*shard\(\s*(-?\d+)\s*\)\s*$", re.IGNORECASE)


def parse_layout(layout: str | Placement | None) -> Placement | None:
    """``"replicate"`` → ``Replicate()``, ``"shard(1)"`` → ``Shard(1)``; placements and ``None`` pass through."""
    if layout is None or isinstance(layout, Placement):
        return layout
    if isinstance(layout, str) and layout.strip().lower() == "replicate":
        return Replicate()
    match = _LAYOUT.match(layout) if isinstance(layout, str) else None
    if match is None:
        raise TensorParallelPlanError(f"Unknown layout {layout!r}: use 'replicate' or 'shard(<dim>)'.")
    return Shard(int(match.group(1)))


def build_style(spec: str | dict[str, Any], where: str = "?", module: nn.Module | None = None) -> ParallelStyle:
    """The ``ParallelStyle`` for one plan entry (``module``: the module it applies to, when known)."""
    options = normalize_style(spec, where)
    style = options.pop("style")
    layouts = {k: parse_layout(v) for k, v in options.items() if k.endswith("layouts")}
    local = options.get("use_local_output")
    if style == "fused_colwise":
        return FusedColwiseParallel(layout_from_spec(options), layouts.get("input_layouts"))
    if style == "multihead_attention":
        dim = options.get("sequence_dim")
        return MultiheadAttentionParallel(None if dim is None else int(dim))
    if style == "fused_gate_up":
        return FusedGateUpParallel(layouts.get("input_layouts"))
    if style == "sharded_dropout":
        return sharded_dropout_style(options)
    if style in ("colwise", "rowwise") and module is not None and is_conv1d(module):
        if local is False:
            raise TensorParallelPlanError(f"plan[{where!r}]: a Conv1D's output is always a local tensor")
        return Conv1DParallel(style, layouts.get("input_layouts"), layouts.get("output_layouts"))
    if style in ("colwise", "rowwise"):
        cls = ColwiseParallel if style == "colwise" else RowwiseParallel
        return cls(**layouts, use_local_output=True if local is None else bool(local))
    if style == "sequence_parallel":
        return SequenceParallel(sequence_dim=int(options.get("sequence_dim", 1)), use_local_output=bool(local))
    if style == "replicate":
        return ReplicateParallel()
    if style == "prepare_input":
        return PrepareFirstInput(
            layouts.get("input_layouts") or Replicate(),
            layouts.get("desired_input_layouts") or Replicate(),
            use_local_output=bool(local),
        )
    return PrepareModuleOutput(
        output_layouts=layouts.get("output_layouts") or Replicate(),
        desired_output_layouts=layouts.get("desired_output_layouts") or Replicate(),
        use_local_output=True if local is None else bool(local),
    )


class PrepareFirstInput(ParallelStyle):
    """Redistribute a module's first tensor input (positional, or the first tensor keyword argument).

    Unlike torch's ``PrepareModuleInput`` it does not need the number of positional inputs in advance, so it works
    for attention modules called as ``attn(hidden_states=x, attention_mask=..., position_embeddings=...)``. With
    ``use_local_output=False`` (the default) the module receives a DTensor: its projections then gather once and
    backward reduce-scatters once.
    """

    def __init__(self, input_layout: Placement, desired_layout: Placement, use_local_output: bool = False) -> None:
        self.input_layout = input_layout
        self.desired_layout = desired_layout
        self.use_local_output = use_local_output

    def _convert(self, x: Tensor, mesh: DeviceMesh) -> Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
        if x.placements != (self.desired_layout,):
            x = x.redistribute(placements=(self.desired_layout,))
        return x.to_local() if self.use_local_output else x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            for i, arg in enumerate(args):
                if isinstance(arg, Tensor):
                    return (*args[:i], self._convert(arg, device_mesh), *args[i + 1 :]), kwargs
            for key, value in kwargs.items():
                if isinstance(value, Tensor):
                    return args, {**kwargs, key: self._convert(value, device_mesh)}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class ReplicateParallel(ParallelStyle):
    """Parameters become replicated DTensors on the tp mesh; inputs and outputs stay plain tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dparam = distribute_tensor(param, mesh, [Replicate()], src_data_rank=self.src_data_rank)
                mod.register_parameter(pname, nn.Parameter(dparam, requires_grad=param.requires_grad))

        def inputs(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(
                DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                if isinstance(a, Tensor) and not isinstance(a, DTensor)
                else a
                for a in args
            )

        def outputs(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, outputs)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan) -> dict[str, str]:
    """Parallelize ``model`` in place on the 1-D ``tp_mesh``. Returns the head attributes changed (``"a.n_head":
    "4 → 2"``).

    Checks the plan against the mesh size first (:meth:`TensorParallelPlan.validate`), so nothing is changed when a
    size does not divide.
    """
    tp = tp_mesh.size()
    plan.validate(tp)
    register_truth_test_sharding()  # anomaly detection's NaN test on tp-sharded gradients
    modules = dict(model.named_modules())
    tied = _tied_parameters(model)
    frozen = [name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]
    # Parents before children: a parent's input hook must see what its parent handed it.
    replicated_kv = {  # key/value projections of attention with fewer key/value heads than tp
        f"{attn}.{proj}": info["kv_heads"]
        for attn, info in plan.grouped_query.items()
        if info["kv_heads"] < tp
        for proj in info["projections"]
    }
    for name, spec in plan.styles.items():
        kv_projection = name if name in replicated_kv else column_part_owner(name, plan.lora)
        if kv_projection in replicated_kv:  # a LoRA-wrapped one: its base layer and lora_B alike
            style: ParallelStyle = ReplicatedKVHeadParallel(replicated_kv[kv_projection])
        else:
            style = build_style(spec, name, modules[name])
        parallelize_module(modules[name], tp_mesh, style)
        if type(modules[name]).__name__ == "FalconLinear" and style_name(spec) == "rowwise":
            # Falcon adds the attention output to the MLP's in place; a local output is a view DTensor made
            modules[name].register_forward_hook(_owned_output)
    _retie(model, tied)
    _keep_frozen(model, frozen)
    mark_partial_over_tp(model, plan.partial_over_tp)
    changed: dict[str, str] = {}
    for name, attrs in plan.head_attributes.items():
        for attr, value in attrs.items():
            kv_count = attr.rpartition(".")[2] in (*KV_HEAD_ATTRIBUTES, "n_query_groups")  # litgpt's config
            local = max(value // tp, 1) if kv_count else value // tp
            set_count(modules[name], attr, local)
            changed[f"{name}.{attr}" if name else attr] = f"{value} → {local}"
    for name, info in plan.grouped_query.items():
        heads, kv = info["heads"] // tp, max(info["kv_heads"] // tp, 1)
        if isinstance(getattr(modules[name], "num_key_value_groups", None), int):
            modules[name].num_key_value_groups = heads // kv
        if info["kv_heads"] < tp:
            how = "kv_heads_replicated" if info["projections"] else "kv_heads_split"  # fused: rows split, gathered
            changed[f"{name}.{how}"] = f"each over {tp // info['kv_heads']} ranks"
    if plan.sequence_parallel and plan.token_embedding is not None:
        _check_sequence_length(modules[plan.token_embedding], plan.token_embedding, tp)
    if plan.loss_parallel_head is not None:
        modules[plan.loss_parallel_head].register_forward_hook(_full_logits_outside_training)
    return changed


def tp_sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters tensor parallelism sharded (1-D ``tp`` mesh; FSDP2's 2-D parameters are left to FSDP2)."""
    return [
        p
        for p in {id(p): p for p in model.parameters()}.values()
        if isinstance(p, DTensor) and p.device_mesh.ndim == 1 and any(isinstance(pl, Shard) for pl in p.placements)
    ]


def shard_gradients_like_parameters(parameters: list[nn.Parameter]) -> None:
    """Give each gradient its parameter's layout. torch 2.13 returns the gradient of a vocabulary-sharded
    ``nn.Embedding`` replicated: left so, every tp rank would hold the whole ``[V, H]`` table until the next step
    (2 GiB per rank for a 128K × 4096 fp32 embedding) and the optimizer would slice it at every update.
    Replicated → sharded is a local slice (no communication), copied so the full table's storage is freed."""
    for param in parameters:
        grad = param.grad
        if not isinstance(grad, DTensor) or grad.placements == param.placements:
            continue
        local = grad.redistribute(param.device_mesh, param.placements).to_local().clone()
        param.grad = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )


def _keep_frozen(model: nn.Module, frozen: list[str]) -> None:
    """Freeze again the parameters that were frozen before sharding. torch's ``SequenceParallel`` (2.13) re-registers
    a norm's parameters as new ``nn.Parameter``s that require gradients: the frozen norms of a LoRA or otherwise
    partly frozen model would become trainable, and an optimizer built after setup would update them."""
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)


def _owned_output(module: nn.Module, args: Any, output: Any) -> Any:
    return output.clone() if isinstance(output, Tensor) and not isinstance(output, DTensor) else output


def set_count(module: nn.Module, attribute: str, value: int) -> None:
    """Set ``module.<attribute>``. For ``"config.n_head"`` (litgpt) the config is copied once per module first:
    one config object is usually shared by every layer and the model."""
    owner, _, leaf = attribute.rpartition(".")
    if not owner:
        setattr(module, leaf, value)
        return
    copied: set[str] = module.__dict__.setdefault("_lightning_dist_copied", set())
    if owner not in copied:
        setattr(module, owner, copy.copy(getattr(module, owner)))
        copied.add(owner)
    setattr(getattr(module, owner), leaf, value)


def _full_logits_outside_training(module: nn.Module, args: Any, output: Any) -> Any:
    """Loss parallel keeps training logits vocab-sharded; evaluation and prediction code gets ordinary logits."""
    if isinstance(output, DTensor) and not (module.training and torch.is_grad_enabled()):
        return output.full_tensor()
    return output


def _check_sequence_length(embedding: nn.Module, name: str, tp: int) -> None:
    def check(_: nn.Module, args: tuple) -> None:
        ids = args[0] if args else None
        if isinstance(ids, Tensor) and ids.dim() >= 2 and ids.shape[1] % tp:
            raise TensorParallelPlanError(
                f"sequence_parallel: the input of {name} has sequence length {ids.shape[1]}, which is not divisible"
                f" by tensor_parallel_size={tp}. Use sequences whose length is a multiple of {tp} (pad or crop"
                " them), or turn sequence_parallel off."
            )

    embedding.register_forward_pre_hook(check)


def _tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that share one Parameter object (tied embeddings and heads)."""
    by_id: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            by_id.setdefault(id(param), []).append((module, pname))
    return [owners for owners in by_id.values() if len(owners) > 1]


def _retie(model: nn.Module, tied: list[list[tuple[nn.Module, str]]]) -> None:
    for owners in tied:
        first_module, first_name = owners[0]
        param = getattr(first_module, first_name)
        for module, pname in owners[1:]:
            other = getattr(module, pname)
            if isinstance(param, DTensor) != isinstance(other, DTensor) or (
                isinstance(param, DTensor) and param.placements != other.placements
            ):
                raise TensorParallelPlanError(
                    f"Tied parameters {type(first_module).__name__}.{first_name} and {type(module).__name__}.{pname}"
                    " got different tensor-parallel layouts. Give both modules styles that shard the tied weight"
                    " the same way (e.g. embedding rowwise and head colwise both shard the vocabulary)."
                )
            module.register_parameter(pname, param)


def resolve_plan(
    model: nn.Module,
    explicit: dict[str, Any] | str | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> TensorParallelPlan:
    """The explicit plan when given (keys may hold ``*``; ``"model"``: the plan the model ships with, see
    :func:`~.hugging_face.shipped_plan`), otherwise the inferred one."""
    auto = infer_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if explicit == MODEL_PLAN:
        explicit = shipped_plan(model)
        if not explicit:
            raise TensorParallelPlanError(
                f"plan='model': {type(model).__name__} holds no Hugging Face model with a shipped tensor-parallel plan"
                " (config.base_model_tp_plan). Leave plan out for the automatic plan, or give one."
            )
    return resolve_explicit_plan(model, explicit, auto) if explicit else auto
