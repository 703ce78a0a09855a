"""Finding a model's mixture-of-experts layers from its structure, without module names.

Two shapes are recognized:

- **stacked** (transformers 5.x: Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V3, gpt-oss): one experts module per
  layer holding 3-D parameters ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)`` (transposed in gpt-oss, with
  ``*_bias`` in some), called by its parent as ``experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))``
  after the parent's router (``gate``) chose the experts. Expert parallelism replaces only that call.
- **module list** (litgpt ``LLaMAMoE`` and user code in that shape): a module with an ``experts`` ``ModuleList`` of
  same-class experts beside a router ``gate``.

Experts under other names are named by a pattern (the strategies' ``expert_modules`` option).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch

from torch import nn

STACKED_PARAMETERS = ("gate_up_proj", "down_proj")
STACKED_BIASES = ("gate_up_proj_bias", "down_proj_bias")
ROUTER_NAMES = ("gate", "router")
#: Attributes that hold how many experts a token is routed to (on the MoE block, its router, or a config).
TOP_K_ATTRIBUTES = ("top_k", "num_experts_per_tok", "experts_per_token", "moe_top_k", "router_topk")


class ExpertParallelError(ValueError):
    """Raised when expert parallelism cannot be applied to a model as it is."""


@dataclass
class ExpertLayer:
    """One mixture-of-experts layer.

    Attributes:
        name: The experts module's qualified name (``model.layers.0.mlp.experts``).
        experts: The experts module (3-D parameters, or a ``ModuleList``).
        router: The router's qualified name (``model.layers.0.mlp.gate``), or ``None`` when there is none beside it.
        num_experts: ``E``.
        kind: ``"stacked"`` or ``"module_list"``.
    """

    name: str
    experts: nn.Module
    router: str | None
    num_experts: int
    kind: str

    @property
    def parameter_names(self) -> list[str]:
        return [f"{self.name}.{n}" for n, _ in self.experts.named_parameters()]


def find_expert_layers(model: nn.Module, expert_modules: str | None = None) -> list[ExpertLayer]:
    """Every mixture-of-experts layer of ``model``, in module order (empty for a dense model).

    Args:
        model: The model.
        expert_modules: A pattern (``fnmatch``, ``*`` for any part of a name) of the qualified names of the experts
            modules, for a model whose experts are not found from their structure: each match must be a module with
            3-D ``gate_up_proj``/``down_proj`` parameters or a ``ModuleList`` of same-class experts, whatever its
            name and router. ``None``: found from their structure.
    """
    modules = dict(model.named_modules())
    layers = []
    for name, module in modules.items():
        if expert_modules is not None and not (name and fnmatch(name, expert_modules)):
            continue
        parent_name = name.rpartition(".")[0]
        parent = modules.get(parent_name) if name else None
        router = _router_name(parent, parent_name)
        if _is_stacked(module):
            layers.append(ExpertLayer(name, module, router, module.down_proj.shape[0], "stacked"))
        elif (
            isinstance(module, nn.ModuleList)
            and (expert_modules is not None or _named_experts(name, router))
            and len(module) > 1
            and len({type(m) for m in module}) == 1
        ):
            layers.append(ExpertLayer(name, module, router, len(module), "module_list"))
    if expert_modules is not None and not layers:
        raise ExpertParallelError(_no_match(model, expert_modules))
    return layers


def _named_experts(name: str, router: str | None) -> bool:
    return name.rpartition(".")[2] == "experts" and router is not None


def _no_match(model: nn.Module, experts: str) -> str:
    matched = [n for n, _ in model.named_modules() if n and fnmatch(n, experts)]
    lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1][:6]
    what = (
        f"it matches {', '.join(matched[:4])}, none of them a ModuleList of same-class experts or a module with 3-D"
        " gate_up_proj/down_proj parameters"
        if matched
        else "it matches no module name"
    )
    return (
        f"expert_modules={experts!r} names no experts module: {what}. The model's ModuleLists of more than one"
        f" module: {', '.join(lists) or 'none'}. Give a pattern of the experts modules' qualified names (* for any"
        " part), e.g. 'model.layers.*.mlp.experts'."
    )


def describe_dense(model: nn.Module) -> str:
    """What the recognizer looked for and what ``model`` has instead, for the message of a model without experts."""
    three_d = [n for n, p in model.named_parameters() if p.dim() == 3][:4]
    lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n.rpartition(".")[2] == "experts"]
    found = []
    if three_d:
        found.append(
            f"3-D parameters {', '.join(three_d)} (not a gate_up_proj/down_proj pair with a leading expert dim)"
        )
    if lists:
        found.append(f"ModuleLists named experts without a router 'gate' beside them: {', '.join(lists[:4])}")
    return (
        f"{type(model).__name__} has no mixture-of-experts layer: looked for an experts module with 3-D"
        " parameters gate_up_proj (E, 2I, H) and down_proj (E, H, I) (transformers 5.x MoE models), and for an"
        " 'experts' ModuleList beside a router 'gate' (litgpt LLaMAMoE); found "
        + ("; ".join(found) if found else "neither (a dense model)")
        + ". Expert parallelism needs a mixture-of-experts model: use plain fsdp2 for a dense one. If the model"
        " keeps its experts another way, name them with expert_modules (a pattern of their qualified names, e.g."
        " 'model.layers.*.moe.expert_list')."
    )


def _is_stacked(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    if not all(n in params for n in STACKED_PARAMETERS):
        return False
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    return gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0] > 1


def _router_name(parent: nn.Module | None, parent_name: str) -> str | None:
    if parent is None:
        return None
    for attr in ROUTER_NAMES:
        if isinstance(getattr(parent, attr, None), nn.Module):
            return f"{parent_name}.{attr}" if parent_name else attr
    return None


def experts_per_token(model: nn.Module, layer: ExpertLayer) -> int | None:
    """``k`` of ``layer``'s top-k routing, read from :data:`TOP_K_ATTRIBUTES` on its experts module, its parent (the
    MoE block) and the parent's other children (the router), or a ``config`` attribute of any of them or of
    ``model``; ``None`` when none says it."""
    parent = dict(model.named_modules()).get(layer.name.rpartition(".")[0])
    owners = [layer.experts] + ([parent, *parent.children()] if parent is not None else [])
    owners += [getattr(m, "config", None) for m in (*owners, model)]
    for owner in owners:
        for attribute in TOP_K_ATTRIBUTES:
            value = getattr(owner, attribute, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


@dataclass(frozen=True)
class RoutedExperts:
    """One layer's routed experts: where they are, their parameters (all experts together) and the routing."""

    name: str
    params: int
    experts: int
    top_k: int | None  # None: not found on the model


def find_experts(model: nn.Module) -> list[RoutedExperts]:
    """The routed experts of ``model``, one entry per layer, as expert parallelism recognizes them
    (:func:`find_expert_layers`: ``transformers`` 5.x stacked experts, or an ``experts`` ModuleList beside a router):
    what FLOPs per token and the mesh planner count. ``k`` is read from :data:`TOP_K_ATTRIBUTES` on the experts
    module, its parent (the MoE block) and the parent's other children (the router), or a ``config`` attribute of any
    of them or of ``model``."""
    return [
        RoutedExperts(
            layer.name,
            sum(p.numel() for p in layer.experts.parameters()),
            layer.num_experts,
            experts_per_token(model, layer),
        )
        for layer in find_expert_layers(model)
    ]
