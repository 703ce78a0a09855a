"""Cutting pipeline stages out of an unchanged model: keep the modules, replay the user's forward on every stage.

Choice and why. torch offers a tracer (``torch.distributed.pipelining.pipeline`` over ``torch.export``) that splits
a forward into graph pieces. It was rejected as the default because it specialises every piece on the example
batch (an evaluation batch of another size needs a new trace), builds stages whose P2P warm-up crashes V-schedules
on gloo, hides the blocks inside graph modules (FSDP2 and tensor parallel then need a second code path), needs the
whole model and an exportable forward, and leaves tied weights to the user. Instead the model object is kept:

* **A stage is a shell of the model**: a shallow copy of the root and of every container on the path to the units
  (see :mod:`.split`). The stage's own units are the original module objects, so parameter names are the original
  fully qualified names (DCP checkpoints are interchangeable with fsdp2), and ``fully_shard``/``parallelize_module``
  apply to a shell's blocks and root exactly as to the whole model. Units of other stages are replaced by
  parameter-free stand-ins; on the original model too, so after :func:`cut_pipeline_stages` the model's
  ``parameters()`` are exactly this rank's (what ``configure_optimizers`` sees). A model built on the meta device
  stays on meta until the caller materialises the shells (``to_empty``): only local units hold storage.
* **Every stage runs the user's forward from the start** with the micro-batch's model inputs (all stages receive
  them as keyword arguments; only the activation travels between ranks). Units of earlier stages return
  zero placeholders shaped like their real output (found by running a parameter-free meta-device copy, cached per
  input shape; one tensor per shape and micro-batch, shared by all of them), so the glue code between modules
  (masks, rotary tables, position ids) is recomputed on each stage instead of being sent. The first local unit's first tensor argument is replaced by the activation received from
  the previous stage. The first unit of a later stage ends the forward and its first tensor argument is the stage's
  output. The last stage's return value is flattened to its tensors (and rebuilt for the loss function).

* **Tied weights** (an embedding shared with the head) stay tied inside a stage; across stages each stage keeps its
  own copy under its own name (``transformer.wte.weight`` / ``lm_head.weight``), Megatron style: copies on one rank
  are separate Parameters too (torch's split backward of zero-bubble schedules mis-accumulates a shared one), and
  :func:`~.tied.all_reduce_tied_gradients` sums their gradients after each step.
* **FSDP2 after evaluation**: a forward-only pass leaves an FSDP root unsharded; reshard before the next step.

Limits (checked where possible, with an error naming the fix):

* Exactly one tensor crosses each stage boundary: the first tensor argument of the first unit of the next stage
  (the hidden state of every transformer). A forward that feeds a block from anything computed by an earlier stage's
  modules other than that tensor (a skip connection from the embedding, say) would read a placeholder: the first
  training forward of each stage checks the autograd graph and raises.
* Units must run in the order of the split; a unit of an earlier stage running after a local one raises.
* A forward that reads another stage's weights directly (``self.tok_emb.weight`` in the head) raises, naming it.
* Glue is recomputed on each stage: cheap for masks and rotary tables, wasteful for heavy parameter-free work.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_dist.compat import child_module_registry
from lightning_dist.parallel.pipeline.order import meta_twin, on_meta
from lightning_dist.parallel.pipeline.outputs import OutputRecipe, flatten_output, map_tensors
from lightning_dist.parallel.pipeline.split import StagePlan


class StageCutError(RuntimeError):
    """The forward does not fit the stage cut (order, extra cross-stage values, direct reads of remote weights)."""


class _StageExit(BaseException):
    """Ends a stage's forward at the next stage's first unit (BaseException: a user's ``except Exception`` must not
    swallow it)."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value


@dataclass
class _Run:
    """State of one stage forward."""

    received: torch.Tensor | None
    substituted: bool = False
    started: bool = False
    placeholders: list[torch.Tensor] = field(default_factory=list)
    #: one zero tensor per shape and dtype, returned by every stand-in of an earlier unit with that output: the last
    #: stage of a deep pipeline calls a hundred earlier blocks, and a tensor each would hold them all at once
    zeros: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = field(default_factory=dict)


class StageRuntime:
    """What the stand-ins and hooks of one stage share while that stage's forward runs."""

    def __init__(self, stage_index: int, num_stages: int, plan: StagePlan, device: torch.device) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.plan = plan
        self.device = device
        self.run: _Run | None = None
        self.verified = False
        self.output_recipe: OutputRecipe | None = None
        # A second boundary tensor beside the activation (the router's statistics, :mod:`.router_statistics`)
        self.carry: Any = None

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def describe(self) -> str:
        return f"stage {self.stage_index} ({', '.join(self.plan.stages[self.stage_index])})"


def _cut_error(runtime: StageRuntime, problem: str) -> StageCutError:
    return StageCutError(
        f"Pipeline {runtime.describe()}: {problem} Pass split= as one list of module names per stage, in the order"
        " the forward runs them, or use another parallelism for this model."
    )


class _StandIn(nn.Module):
    """A parameter-free module in place of a unit that lives on another stage."""

    unit_name: str
    owner_stage: int

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            runtime = self.__dict__.get("_runtime")
            message = (
                f"The forward reads {self.unit_name}.{name}, which lives on pipeline stage {self.owner_stage}, not"
                " on this one (every stage runs the whole forward but holds only its own modules, so a module's"
                " weights or attributes can be read only inside its stage)."
            )
            raise AttributeError(message if runtime is None else str(_cut_error(runtime, message))) from None

    def extra_repr(self) -> str:
        return f"{self.unit_name} on stage {self.owner_stage}"


class EarlierStageModule(_StandIn):
    """Stands in for a unit of an earlier stage: returns zero placeholders shaped like the unit's output."""

    def __init__(self, name: str, owner: int, twin: nn.Module, runtime: StageRuntime) -> None:
        super().__init__()
        self.unit_name, self.owner_stage = name, owner
        # Plain attributes (not submodules): the meta twin must not show up in parameters() or state_dict().
        object.__setattr__(self, "_twin", twin)
        object.__setattr__(self, "_runtime", runtime)
        object.__setattr__(self, "_shapes", {})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runtime = self._runtime
        run = runtime.run
        if run is None:
            raise _cut_error(
                runtime, f"{self.unit_name} (stage {self.owner_stage}) was called outside a stage forward."
            )
        if run.started:
            raise _cut_error(
                runtime,
                f"{self.unit_name} of the earlier stage {self.owner_stage} runs after this stage's modules began.",
            )
        key = _signature((args, kwargs))
        if key not in self._shapes:
            meta_args = map_tensors((args, kwargs), _to_meta)
            with on_meta():
                self._shapes[key] = self._twin(*meta_args[0], **meta_args[1])
        grad = torch.is_grad_enabled()

        def placeholder(meta: torch.Tensor) -> torch.Tensor:
            key = (tuple(meta.shape), meta.dtype)
            if (value := run.zeros.get(key)) is None:
                value = run.zeros[key] = torch.zeros(meta.shape, dtype=meta.dtype, device=runtime.device)
                if grad and (value.is_floating_point() or value.is_complex()):
                    value.requires_grad_(True)
                    run.placeholders.append(value)
            return value

        return map_tensors(self._shapes[key], placeholder)


class LaterStageModule(_StandIn):
    """Stands in for a unit of a later stage: its call ends this stage's forward, its input is the stage output."""

    def __init__(self, name: str, owner: int, runtime: StageRuntime) -> None:
        super().__init__()
        self.unit_name, self.owner_stage = name, owner
        object.__setattr__(self, "_runtime", runtime)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runtime = self._runtime
        run = runtime.run
        if run is None or not run.started:
            raise _cut_error(
                runtime, f"{self.unit_name} of the later stage {self.owner_stage} runs before any module of this stage."
            )
        value = _first_tensor(args, kwargs)
        if value is None:
            raise _cut_error(
                runtime, f"{self.unit_name} (first module of stage {self.owner_stage}) got no tensor input."
            )
        raise _StageExit(value)


class ElsewhereModule(_StandIn):
    """Left in the user's model where a unit of another rank's stage was: no parameters, cannot run."""

    def __init__(self, name: str, owner: int) -> None:
        super().__init__()
        self.unit_name, self.owner_stage = name, owner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.unit_name} lives on pipeline stage {self.owner_stage} of another rank; run the model through its"
            " pipeline stages, not directly."
        )


def cut_pipeline_stages(
    model: nn.Module, plan: StagePlan, stage_ids: Sequence[int], device: torch.device | str
) -> list[nn.Module]:
    """Build this rank's stage modules (one per id in ``stage_ids``) and strip other ranks' units from ``model``.

    Args:
        model: The unchanged model, on any device including meta.
        plan: The stage plan (:func:`~.split.plan_stages`).
        stage_ids: The stages this rank holds (:func:`~.split.stage_ids_for_rank`).
        device: Where activations live (placeholders are created there).

    Returns:
        One module per stage id. Its ``forward(*received, **model_inputs)`` takes the previous stage's activation
        (nothing on stage 0) and the model's call as keyword arguments (:func:`model_inputs_as_kwargs`). Non-last
        stages return the boundary activation; the last stage returns the tensors of the model's output (see
        :func:`stage_runtime` for the recipe to rebuild it).
    """
    device = torch.device(device)
    forward_fn = type(model).forward
    owner = {unit: index for index, units in enumerate(plan.stages) for unit in units}
    _untie_between_local_stages(model, owner, stage_ids)
    local = {unit for s in stage_ids for unit in plan.stages[s]}
    twins = {u: meta_twin(model.get_submodule(u)) for u in owner if any(owner[u] < s for s in stage_ids)}
    parts = []
    for stage in stage_ids:
        runtime = StageRuntime(stage, plan.num_stages, plan, device)
        roles: dict[str, nn.Module] = {}
        for unit, unit_stage in owner.items():
            if unit_stage == stage:
                module = model.get_submodule(unit)
                module.register_forward_pre_hook(_make_entry_hook(runtime), with_kwargs=True)
                roles[unit] = module
            elif unit_stage < stage:
                roles[unit] = EarlierStageModule(unit, unit_stage, twins[unit], runtime)
            else:
                roles[unit] = LaterStageModule(unit, unit_stage, runtime)
        shell = _shell(model, roles)
        object.__setattr__(shell, "pipeline_runtime", runtime)
        shell.forward = _make_stage_forward(shell, forward_fn, runtime)
        parts.append(shell)
    for unit, unit_stage in owner.items():
        if unit not in local:
            model.set_submodule(unit, ElsewhereModule(unit, unit_stage))
    return parts


def stage_runtime(part: nn.Module) -> StageRuntime:
    """The runtime of a stage module built by :func:`cut_pipeline_stages` (stage index, output recipe)."""
    return part.pipeline_runtime


def model_inputs_as_kwargs(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model call ``model(*args, **kwargs)`` as keyword arguments only (pipeline stages take keywords).

    Raises:
        TypeError: the call does not match the forward's signature, or passes extra positional (``*args``) values.
    """
    import inspect

    signature = inspect.signature(type(model).forward)
    bound = signature.bind(None, *args, **kwargs)
    out: dict[str, Any] = {}
    for index, (name, value) in enumerate(bound.arguments.items()):
        if index == 0:
            continue  # self
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(
                    f"{type(model).__name__}.forward takes *{name}; a pipelined call must pass named arguments."
                )
        elif kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _make_entry_hook(runtime: StageRuntime) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        run = runtime.run
        if run is None:  # not inside this stage's forward (activation-checkpoint recompute, another caller)
            return None
        run.started = True
        if run.received is None or run.substituted:
            return None
        run.substituted = True
        return _replace_first_tensor(args, kwargs, run.received, runtime)

    return hook


def _make_stage_forward(shell: nn.Module, forward_fn: Callable, runtime: StageRuntime) -> Callable:
    def forward(*received: torch.Tensor, **model_inputs: Any) -> Any:
        carry = runtime.carry
        if len(received) > 1 + (carry is not None):
            raise _cut_error(runtime, f"expected one activation from the previous stage, got {len(received)}.")
        side = received[1] if carry is not None and len(received) > 1 else None
        run = _Run(received[0] if received else None)
        runtime.run = run
        try:
            with carry.running(side, runtime.is_last) if carry is not None else contextlib.nullcontext():
                try:
                    output = forward_fn(shell, **model_inputs)
                    exited = None
                except _StageExit as exit_:
                    exited = exit_.value
        finally:
            runtime.run = None
        if run.received is not None and not run.substituted:
            raise _cut_error(runtime, "the forward finished without running any module of this stage.")
        if runtime.is_last:
            if exited is not None:
                raise _cut_error(runtime, "the last stage reached a module of a later stage.")
            flat, runtime.output_recipe = flatten_output(output)
            result: Any = _joined(flat, side)
        else:
            if exited is None:
                raise _cut_error(
                    runtime, f"the forward returned without reaching stage {runtime.stage_index + 1}'s first module."
                )
            result = exited if carry is None else (exited, carry.sums(side, model_inputs, runtime.device))
        if not runtime.verified and run.placeholders and torch.is_grad_enabled():
            outputs = list(result) if isinstance(result, tuple) else [result]
            if _depends_on(outputs, run.placeholders):
                raise _cut_error(
                    runtime,
                    "its output depends on what modules of an earlier stage computed other than the activation passed"
                    " between stages (for example a skip connection from the embedding).",
                )
            runtime.verified = True
        return result

    return forward


def _joined(flat: Any, side: torch.Tensor | None) -> Any:
    """The last stage's output tensors, the first floating one plus ``0 · side``: the received side tensor then
    always gets a gradient (zero where the loss does not use it), which the schedule sends back."""
    if side is None or not side.requires_grad:
        return flat
    out = list(flat)
    for i, tensor in enumerate(out):
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            out[i] = tensor + 0 * side.sum().to(tensor.dtype)
            return type(flat)(out) if isinstance(flat, tuple) else out
    return flat


_SHARED_REGISTRIES = ("_buffers", "_non_persistent_buffers_set")


def _shell(root: nn.Module, roles: dict[str, nn.Module]) -> nn.Module:
    """A copy of ``root`` sharing every module except the containers on the way to ``roles``' names."""

    def clone(module: nn.Module, prefix: str) -> nn.Module:
        copied = module.__class__.__new__(module.__class__)
        # Registries (_modules, _parameters, hooks, ...) are copied so the shell's changes stay its own; buffers are
        # shared: materializing a meta-device model replaces them in the original's registry (litgpt keeps its
        # rotary cache on the root), and the shell must see the real ones.
        copied.__dict__ = {
            k: (copy.copy(v) if isinstance(v, (dict, set)) and k not in _SHARED_REGISTRIES else v)
            for k, v in module.__dict__.items()
        }
        children = child_module_registry(copied)
        for name, child in child_module_registry(module).items():
            qualified = f"{prefix}{name}"
            if qualified in roles:
                children[name] = roles[qualified]
            elif child is not None and any(u.startswith(f"{qualified}.") for u in roles):
                children[name] = clone(child, f"{qualified}.")
        return copied

    return clone(root, "")


def _untie_between_local_stages(model: nn.Module, owner: dict[str, int], stage_ids: Sequence[int]) -> None:
    """Give each local stage its own copy of a parameter tied across stages (torch's split backward of the
    zero-bubble schedules mis-accumulates one Parameter used by two stages of a rank); the copies' gradients are
    summed by :func:`~.tied.all_reduce_tied_gradients`."""
    placed = []  # (stage, name, param) of this rank's stages, in stage order: the earliest stage keeps the original
    for name, param in model.named_parameters(remove_duplicate=False):
        unit = next((u for u in owner if name.startswith(f"{u}.")), None)
        if unit is not None and owner[unit] in stage_ids:
            placed.append((owner[unit], name, param))
    seen: dict[int, int] = {}  # id(param) -> stage of its first name
    for stage, name, param in sorted(placed, key=lambda entry: entry[0]):
        first = seen.setdefault(id(param), stage)
        if first != stage:
            module_name, _, leaf = name.rpartition(".")
            copy_ = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
            model.get_submodule(module_name).register_parameter(leaf, copy_)


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _signature(value: Any) -> Any:
    """A hashable key for the shapes and structure of a module call (the meta run is cached per key)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, (int, float, bool, str, type(None))):
        return value
    return type(value).__name__


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _replace_first_tensor(
    args: tuple, kwargs: dict, received: torch.Tensor, runtime: StageRuntime
) -> tuple[tuple, dict]:
    def check(old: torch.Tensor) -> None:
        if tuple(old.shape) != tuple(received.shape):
            raise _cut_error(
                runtime,
                f"the activation from the previous stage has shape {tuple(received.shape)} but this stage's first"
                f" module expects {tuple(old.shape)}.",
            )

    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            check(value)
            return (*args[:i], received, *args[i + 1 :]), kwargs
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            check(value)
            return args, {**kwargs, key: received}
    raise _cut_error(runtime, "this stage's first module takes no tensor, so it cannot receive the activation.")


def _depends_on(outputs: list[torch.Tensor], placeholders: list[torch.Tensor]) -> bool:
    """Whether any of ``outputs`` was computed from one of ``placeholders`` (walks the autograd graph once)."""
    targets = {id(p) for p in placeholders}
    if any(id(o) in targets for o in outputs):
        return True
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    seen: set = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in targets:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False
