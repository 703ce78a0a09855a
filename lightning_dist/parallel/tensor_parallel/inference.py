"""Working out the automatic tensor-parallel plan from a model's recognised structure, and resolving explicit plans.

Attention projections go column-wise for query/key/value and row-wise for the output, MLPs column-wise for up/gate
(a fused ``[gate | up]`` so that each rank holds matching halves) and row-wise for down, the token embedding row-wise
(over the vocabulary) and the output head column-wise. What :func:`~lightning_dist.parallel.model_structure.recognize`
could not understand is left replicated and reported by name; parameters that would silently get a different gradient
on each rank make the plan refuse. Pure inspection.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any

from torch import nn

from lightning_dist.compat.peft import BASE_LAYER
from lightning_dist.parallel.model_structure import (
    Attention,
    ModelStructure,
    is_norm,
    join,
    projection_features,
    recognize,
)
from lightning_dist.parallel.tensor_parallel.fused import fused_spec
from lightning_dist.parallel.tensor_parallel.lora import adapters_left_whole, expand_lora
from lightning_dist.parallel.tensor_parallel.hugging_face import from_hugging_face_style
from lightning_dist.parallel.tensor_parallel.plan import (
    SEQUENCE_GATHER,
    DivisibilityCheck,
    StyleSpec,
    TensorParallelPlan,
    TensorParallelPlanError,
    fused_kv_checks,
    match_modules,
    normalize_style,
    shard_dim,
    size_checks,
    style_name,
)

_MHA_SEQUENCE_PARALLEL = (
    "nn.MultiheadAttention with batch_first=False under sequence_parallel (the residual stream is split on dim 1,"
    " its sequence dim is 0)"
)
_FUSED_UP_ODD = "fused gate/up projection with an odd number of outputs: no [gate | up] halves to shard"


def infer_plan(model: nn.Module, sequence_parallel: bool = False, loss_parallel: bool = False) -> TensorParallelPlan:
    """Work out the tensor-parallel plan of ``model``. Pure inspection; nothing changes.

    Args:
        model: The single-device model.
        sequence_parallel: Shard norms and the residual stream on the sequence dim (dim 1) between the blocks.
        loss_parallel: Leave the output head's logits sharded on the vocabulary for a parallel cross-entropy.
    """
    structure = recognize(model)
    modules = dict(model.named_modules(remove_duplicate=False))  # a shared child under every name
    plan = TensorParallelPlan(sequence_parallel=sequence_parallel)
    checked: set[str] = set()  # attention/MLP modules whose other parameters were checked

    def row_out() -> StyleSpec:  # a fresh dict per entry (shared objects would print as YAML anchors)
        return {"style": "rowwise", "output_layouts": "shard(1)"} if sequence_parallel else "rowwise"

    plan.unplanned.update(structure.unsupported)
    for name, attention in structure.attention.items():
        if isinstance(modules[name], nn.MultiheadAttention):
            if sequence_parallel and not modules[name].batch_first:
                plan.unplanned[name] = _MHA_SEQUENCE_PARALLEL
                continue
            # under sequence parallel it gathers its inputs' sequence and reduce-scatters its output itself
            plan.styles[name] = (
                {"style": "multihead_attention", "sequence_dim": 1} if sequence_parallel else "multihead_attention"
            )
            checked.add(name)
            plan.checks.append(
                DivisibilityCheck(name, "attention heads (nn.MultiheadAttention.num_heads)", attention.num_heads)
            )
            plan.head_attributes[name] = dict(attention.count_attributes)
            continue
        projections = [p for p in (attention.query, attention.key, attention.value, attention.fused) if p]
        _check_extra_parameters(
            plan,
            name,
            modules[name],
            {*projections, attention.output},
            "attention heads",
            _attention_sizes(modules, attention),
            width=projection_features(modules[join(name, projections[0])])[0],
            head_dim=attention.head_dim,
        )
        if attention.fused_layout is not None:
            plan.styles[join(name, attention.fused)] = fused_spec(attention.fused_layout)
        else:
            for proj in projections:
                plan.styles[join(name, proj)] = "colwise"
        plan.styles[join(name, attention.output)] = row_out()
        if sequence_parallel:
            plan.styles[name] = dict(SEQUENCE_GATHER)
        _attention_checks(plan, modules, attention)
        checked.add(name)
    for name, mlp in structure.mlps.items():
        up_features = {up: projection_features(modules[join(name, up)])[1] for up in mlp.up}
        if mlp.fused_up is not None:  # [gate | up]: the hidden units are half its outputs
            if up_features[mlp.fused_up] % 2:
                plan.unplanned[join(name, mlp.fused_up)] = _FUSED_UP_ODD
                continue
            up_features[mlp.fused_up] //= 2
        if mlp.up == ("linear1",):  # nn.TransformerEncoderLayer / DecoderLayer
            linear1 = {"style": "colwise", "input_layouts": "shard(1)"} if sequence_parallel else "colwise"
            plan.styles[join(name, "linear1")] = linear1
            if sequence_parallel:  # the layer keeps the residual stream and its norms inside
                for child, module in modules[name].named_children():
                    if is_norm(module):  # its output is the residual stream: a plain tensor, as the layer adds to it
                        plan.styles[join(name, child)] = {"style": "sequence_parallel", "use_local_output": True}
        else:
            width = projection_features(modules[join(name, mlp.up[0])])[0]
            sharded = {*mlp.up, mlp.down}
            hidden = set(up_features.values())
            if mlp.fused_up is not None:
                hidden.add(2 * up_features[mlp.fused_up])
            _check_extra_parameters(plan, name, modules[name], sharded, "MLP hidden units", hidden, width)
            for up in mlp.up:
                plan.styles[join(name, up)] = "fused_gate_up" if up == mlp.fused_up else "colwise"
            checked.add(name)
        for up, features in up_features.items():
            plan.checks.append(DivisibilityCheck(join(name, up), "MLP hidden size", features))
        plan.styles[join(name, mlp.down)] = row_out()
        if sequence_parallel and mlp.up != ("linear1",):
            plan.styles[name] = dict(SEQUENCE_GATHER)
    if _plan_embeddings_and_head(modules, structure, plan, sequence_parallel, loss_parallel):
        checked.update(structure.other_embeddings)  # they see the whole sequence: split at the first block
    if sequence_parallel:
        for norm in structure.norms:
            plan.styles[norm] = "sequence_parallel"
        _check_sequence_parallel_coverage(model, plan, checked)
    expand_lora(modules, plan)
    adapters_left_whole(modules, plan, structure.claimed)
    _one_name_per_module(model, plan)
    _check_tied_parameters(model, plan)
    # Keep the model's own order (parents before children), which is also the order printed to users.
    order = {n: i for i, n in enumerate(modules)}
    plan.styles = dict(sorted(plan.styles.items(), key=lambda item: order[item[0]]))
    return plan


def _check_tied_parameters(model: nn.Module, plan: TensorParallelPlan) -> None:
    """A weight shared by a planned and an unplanned module (BERT's decoder tied to its sharded word embeddings,
    when the decoder is not recognised as the output head) would be sharded at one end and whole at the other."""
    owners: dict[int, list[str]] = defaultdict(list)
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            owners[id(param)].append(join(name, pname))
    for names in owners.values():
        planned = [n for n in names if n.rpartition(".")[0] in plan.styles]
        if planned and len(planned) < len(names):
            whole = [n for n in names if n not in planned]
            plan.tied[planned[0]] = (
                f"tied to {', '.join(whole)}, which the automatic plan does not shard: the tied copies would get"
                " different layouts"
            )


def resolve_explicit_plan(
    model: nn.Module, plan: dict[str, StyleSpec], auto: TensorParallelPlan | None = None
) -> TensorParallelPlan:
    """Expand a user's plan (keys may hold ``*``) to exact module names and derive the checks it needs.

    Head-count attributes are adjusted for attention modules (as the automatic plan recognises them) whose query,
    key and value projections are all column-wise in the user's plan.
    """
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    resolved = TensorParallelPlan(explicit=True)
    for key, spec in plan.items():
        options = normalize_style(spec, key)
        matched = match_modules(key, names)
        if not matched:
            close = [n for n in names if n.split(".")[-1] == key.split(".")[-1]][:5]
            raise TensorParallelPlanError(
                f"plan key {key!r} matches no module of {type(model).__name__}"
                + (f" (modules with that last name: {close})" if close else "")
                + ". Print the automatic plan (`lightning-dist plan ...`) to see the module names."
            )
        for name in matched:
            resolved.styles[name] = from_hugging_face_style(spec)
            resolved.checks.extend(size_checks(name, modules[name], options))
            sharded_logits = shard_dim(options.get("output_layouts")) in (-1, 2)
            if options["style"] == "colwise" and options.get("use_local_output") is False and sharded_logits:
                resolved.loss_parallel_head = name
            if options["style"] == "sequence_parallel":
                resolved.sequence_parallel = True
    expand_lora(modules, resolved)
    order = {n: i for i, n in enumerate(names)}
    resolved.styles = dict(sorted(resolved.styles.items(), key=lambda item: order[item[0]]))
    auto = auto if auto is not None else infer_plan(model)
    resolved.token_embedding = auto.token_embedding if auto.token_embedding in resolved.styles else None
    attention = recognize(model).attention
    for attn, attrs in auto.head_attributes.items():
        info = attention.get(attn)
        if info is None:
            continue
        sharded = [join(attn, p) for p in (info.query, info.key, info.value, info.fused) if p and p != "in_proj"]
        by_heads = ("colwise", "fused_colwise")
        whole = style_name(resolved.styles.get(attn, "")) == "multihead_attention"
        # a LoRA-wrapped projection's style is its base layer's
        styles = [resolved.styles.get(n, resolved.styles.get(join(n, BASE_LAYER), "")) for n in sharded]
        if whole or sharded and all(style_name(style) in by_heads for style in styles):
            resolved.head_attributes[attn] = attrs
            resolved.checks.extend(c for c in auto.checks if c.module == attn)
            if attn in auto.grouped_query:
                resolved.grouped_query[attn] = auto.grouped_query[attn]
    return resolved


def _one_name_per_module(model: nn.Module, plan: TensorParallelPlan) -> None:
    """A module shared by several blocks (one ``nn.Linear`` in two MLPs) is planned, sharded and has its head counts
    divided once, under the name ``named_modules`` gives it first."""
    canonical = {id(module): name for name, module in model.named_modules()}

    def first_name(name: str) -> str:
        return canonical[id(model.get_submodule(name))] if name else name

    styles: dict[str, StyleSpec] = {}
    for name, spec in plan.styles.items():
        styles.setdefault(first_name(name), spec)
    plan.styles = styles
    heads: dict[str, dict[str, int]] = {}
    for name, attrs in plan.head_attributes.items():
        heads.setdefault(first_name(name), attrs)
    plan.head_attributes = heads


def _attention_sizes(modules: dict[str, nn.Module], attention: Attention) -> set[int]:
    """Sizes of the activations tensor parallelism splits in an attention module: projection widths, head_dim and
    head counts."""
    projections = [p for p in (attention.query, attention.key, attention.value, attention.fused) if p]
    sizes = {projection_features(modules[join(attention.name, p)])[1] for p in projections}
    counts = [*attention.count_attributes.values(), attention.head_dim or 0, attention.num_heads or 0]
    return sizes | {c for c in counts if c > 1}


def _attention_checks(plan: TensorParallelPlan, modules: dict[str, nn.Module], attention: Attention) -> None:
    name = attention.name
    if attention.num_heads is not None:
        plan.checks.append(DivisibilityCheck(name, "attention heads", attention.num_heads))
    if attention.num_kv_heads is not None and attention.num_kv_heads != attention.num_heads:
        layout = attention.fused_layout
        shareable = layout.order == "blocks" if layout is not None else attention.num_heads is not None
        if layout is not None:
            plan.checks += fused_kv_checks(name, layout.num_kv_heads, layout.head_dim, shareable)
        else:
            what = "key/value heads (grouped-query attention)"
            plan.checks.append(DivisibilityCheck(name, what, attention.num_kv_heads, or_divides=shareable))
        if shareable:
            plan.grouped_query[name] = {
                "heads": attention.num_heads,
                "kv_heads": attention.num_kv_heads,
                "projections": [] if layout is not None else [attention.key, attention.value],
            }
    if attention.fused is None:
        for proj, what in ((attention.query, "query"), (attention.key, "key"), (attention.value, "value")):
            features = projection_features(modules[join(name, proj)])[1]
            check = DivisibilityCheck(
                name, f"{what} projection output features", features, or_divides=proj != attention.query
            )
            plan.checks.append(check)
    output_in = projection_features(modules[join(name, attention.output)])[0]
    plan.checks.append(DivisibilityCheck(join(name, attention.output), "attention width (input features)", output_in))
    if attention.count_attributes:
        plan.head_attributes[name] = dict(attention.count_attributes)


def _plan_embeddings_and_head(
    modules: dict[str, nn.Module],
    structure: ModelStructure,
    plan: TensorParallelPlan,
    sequence_parallel: bool,
    loss_parallel: bool,
) -> bool:
    """Plan the token embedding, other embeddings and the output head; returns whether the sequence is split at the
    first block (the embeddings' outputs stay whole)."""
    token = structure.token_embedding
    split_at_first_block = sequence_parallel and _positions_from_sequence_length(structure, modules)
    if token is not None:
        plan.token_embedding = token
        plan.styles[token] = {
            "style": "rowwise",
            "input_layouts": "replicate",
            "output_layouts": "shard(1)" if sequence_parallel and not split_at_first_block else "replicate",
        }
        vocab = modules[token].num_embeddings
        plan.checks.append(DivisibilityCheck(token, "vocabulary (Embedding.num_embeddings)", vocab))
        if split_at_first_block:
            # The model derives positions and masks from the embeddings' sequence length between the embedding
            # and the first block (Hugging Face decoders): the sequence is split only where the first block starts.
            plan.styles[structure.blocks[0]] = {
                "style": "prepare_input",
                "input_layouts": "replicate",
                "desired_input_layouts": "shard(1)",
                "use_local_output": True,
            }
        elif sequence_parallel:
            # Other embeddings added to the token embedding (learned positions) must be sliced the same way.
            for other in structure.other_embeddings:
                plan.styles[other] = {
                    "style": "prepare_output",
                    "output_layouts": "replicate",
                    "desired_output_layouts": "shard(1)",
                }
    head = structure.output_head
    if head is not None:
        spec: dict[str, Any] = {"style": "colwise"}
        if sequence_parallel:
            spec["input_layouts"] = "shard(1)"
        if loss_parallel:
            spec.update(output_layouts="shard(-1)", use_local_output=False)
            plan.loss_parallel_head = head
        else:
            spec["output_layouts"] = "replicate"
        plan.styles[head] = spec
        plan.checks.append(DivisibilityCheck(head, "vocabulary (Linear.out_features)", modules[head].out_features))
    return split_at_first_block


def _positions_from_sequence_length(structure: ModelStructure, modules: dict[str, nn.Module]) -> bool:
    """Whether a module enclosing the blocks takes positions, i.e. builds them (and its masks) from the sequence
    length of the embeddings it hands the first block, as Hugging Face's ``LlamaModel``/``GPT2Model`` do.

    With learned positions added to the token embedding, only a module that also takes an ``attention_mask`` (and so
    builds the blocks' mask from that length: GPT-2) counts; others (positions from the token ids, causal attention
    without a mask) have their position embedding sliced with the token embedding instead.
    """
    builder = structure.positions_argument or structure.rope_tables  # litgpt: rotary tables sliced by the length
    if builder is None or not structure.blocks:
        return False
    owner = builder[0]
    if not (owner == "" or structure.blocks[0].startswith(f"{owner}.")):
        return False
    return not structure.other_embeddings or "attention_mask" in _forward_parameters(modules[owner])


def _forward_parameters(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _check_extra_parameters(
    plan: TensorParallelPlan,
    name: str,
    module: nn.Module,
    sharded: set[str],
    what: str,
    sharded_sizes: set[int],
    width: int,
    head_dim: int | None = None,
) -> None:
    """Refuse trainable parameters of an attention/MLP module, outside its sharded projections, that act on the
    sharded activations (a Qwen3-style q_norm/k_norm over head_dim, a scale over the MLP hidden units): each rank
    would compute their gradient from its share of heads or hidden units only, and nothing reduces it.

    Whether a parameter acts on the sharded activations is read from its shape: a dim equal to a sharded size
    (hidden units, projection widths, head_dim, head counts) and not to the model width. Parameters over the model
    width (a norm or an ``nn.MultiheadAttention`` beside ``fc1``/``fc2`` in a block) see the whole, replicated
    activations on every rank; frozen parameters get no gradient. Both are fine.

    A parameter of shape ``(head_dim,)`` in a child module of an attention module (Qwen3's, Gemma 3's
    ``q_norm``/``k_norm``) is applied alike to every head: each rank's gradient is its heads' part of the whole, so
    it is recorded in ``plan.partial_over_tp`` (summed over tp) instead of refused.
    """
    ambiguous = sharded_sizes - {width}
    for pname, param in module.named_parameters():
        if pname.split(".")[0] in sharded or not param.requires_grad:
            continue
        if head_dim not in (None, width) and tuple(param.shape) == (head_dim,) and "." in pname:
            plan.partial_over_tp[join(name, pname)] = (
                f"applied to each of this rank's heads (shape {tuple(param.shape)}, head_dim): its gradient is summed"
                " over tp"
            )
            continue
        # a scalar may scale the sharded activations as well as the whole ones: refused as ambiguous
        if param.numel() == 1 or width in sharded_sizes and width in param.shape or ambiguous.intersection(param.shape):
            plan.unreduced[join(name, pname)] = (
                f"a parameter of {type(module).__name__} {name!r} outside its sharded Linear layers"
                f" ({', '.join(sorted(sharded))}), of shape {tuple(param.shape)}; it would see only this rank's {what}"
            )


def _check_sequence_parallel_coverage(model: nn.Module, plan: TensorParallelPlan, checked: set[str]) -> None:
    """With sequence parallel, a parameter of a module the plan does not cover sees only this rank's slice of the
    sequence (a layer-scale Parameter on a block, a norm class the plan does not recognise)."""
    covered = {n for n, s in plan.styles.items() if style_name(s) != "prepare_input"}  # layouts only: not covered
    for pname, _ in model.named_parameters():
        owner = pname.rpartition(".")[0]
        inside = [*checked, *plan.unplanned]  # unplanned modules are refused by validate() already
        if owner in covered or any(owner == g or owner.startswith(f"{g}.") for g in inside):
            continue
        plan.unreduced[pname] = (
            f"not in a module the plan covers ({type(model.get_submodule(owner)).__name__}); with sequence_parallel"
            " it would see only this rank's slice of the sequence (only norms on the residual stream whose class names"
            " end in LayerNorm/RMSNorm are handled)"
        )
