"""Working out a tensor-parallel plan from a model's structure and names, and checking it against a TP size.

A plan maps module names to *styles* (plain data: a string or a small dict, so it can live in YAML):

- ``"colwise"``: shard an ``nn.Linear``'s output features (or an ``nn.Embedding``'s embedding dim) over tp ranks.
- ``"rowwise"``: shard an ``nn.Linear``'s input features (or an ``nn.Embedding``'s vocabulary); outputs are summed.
- ``"sequence_parallel"``: run the module (a norm) on the rank's slice of the sequence dim, parameters replicated.
- ``"replicate"``: parameters replicated on every tp rank (as DTensors), inputs and outputs left as they are.
- ``"prepare_input"`` / ``"prepare_output"``: only change the layout of a module's first input / its output.

A dict adds layouts: ``{"style": "colwise", "output_layouts": "shard(-1)", "use_local_output": false}``; layouts
are ``"replicate"`` or ``"shard(<dim>)"``. Keys may use ``*`` for one name component (``"blocks.*.attn.q"``).

The automatic plan recognises attention projections (query/key/value column-wise, output row-wise), MLPs (up/gate
column-wise, down row-wise), the token embedding and the output head, by the common naming of hand-written GPTs,
Hugging Face decoders (Llama/Mistral/Qwen style), GPT-NeoX/Falcon style separate projections and
``nn.TransformerEncoderLayer``. What it cannot shard correctly (fused QKV, ``nn.MultiheadAttention``, HF ``Conv1D``) is
reported by name.
"""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from torch import nn

StyleSpec = str | dict[str, Any]

STYLES: tuple[str, ...] = (
    "colwise",
    "rowwise",
    "sequence_parallel",
    "replicate",
    "prepare_input",
    "prepare_output",
)
_STYLE_KEYS = {
    "colwise": {"input_layouts", "output_layouts", "use_local_output"},
    "rowwise": {"input_layouts", "output_layouts", "use_local_output"},
    "sequence_parallel": {"sequence_dim", "use_local_output"},
    "replicate": set(),
    "prepare_input": {"input_layouts", "desired_input_layouts", "use_local_output"},
    "prepare_output": {"output_layouts", "desired_output_layouts", "use_local_output"},
}

# Names of child Linear layers, by role. Matched exactly against the child's attribute name.
_Q = ("q_proj", "query", "q", "wq", "q_lin", "to_q", "query_proj")
_K = ("k_proj", "key", "k", "wk", "k_lin", "to_k", "key_proj")
_V = ("v_proj", "value", "v", "wv", "v_lin", "to_v", "value_proj")
_O = ("o_proj", "out_proj", "proj", "dense", "wo", "c_proj", "out_lin", "to_out", "output_proj", "o")
_UP = ("up_proj", "gate_proj", "up", "gate", "fc1", "fc_in", "w1", "w3", "c_fc", "dense_h_to_4h", "wi", "wi_0", "wi_1")
_DOWN = ("down_proj", "down", "fc2", "fc_out", "w2", "c_proj", "dense_4h_to_h", "wo", "proj")
_FUSED_QKV = ("qkv", "c_attn", "query_key_value", "Wqkv", "qkv_proj", "in_proj", "to_qkv", "W_pack")
_TOKEN_EMB = ("embed_tokens", "tok_emb", "wte", "word_embeddings", "embed_in", "tok_embeddings", "token_embedding")
_HEAD = ("lm_head", "head", "output", "embed_out", "out", "output_layer", "logits")

# Attributes of an attention module that hold a global count and must become the local (per-rank) count.
Q_HEAD_ATTRIBUTES = ("n_head", "n_heads", "num_heads", "num_attention_heads", "nheads", "num_q_heads")
KV_HEAD_ATTRIBUTES = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads", "n_head_kv")
WIDTH_ATTRIBUTES = ("hidden_size", "all_head_size", "inner_dim")

SEQUENCE_GATHER: dict[str, Any] = {
    "style": "prepare_input",
    "input_layouts": "shard(1)",
    "desired_input_layouts": "replicate",
}


class TensorParallelPlanError(ValueError):
    """The model cannot be tensor-parallelized as asked; the message names the modules and the numbers."""


@dataclass(frozen=True)
class DivisibilityCheck:
    """``value`` (a size of ``module``) must be divisible by the tp size."""

    module: str
    what: str
    value: int


@dataclass
class TensorParallelPlan:
    """A resolved plan: exact module names → styles, plus what must hold and change for it to be correct.

    Attributes:
        styles: Exact module name → style, in model order.
        head_attributes: Attention module name → ``{attribute: global value}`` to divide by tp when applying.
        checks: Sizes that tp must divide.
        unplanned: Module name → why it was not sharded (left replicated).
        loss_parallel_head: Name of the output head whose logits stay vocab-sharded (loss parallel), if any.
        sequence_parallel: Whether the plan shards the residual stream on the sequence dim.
        token_embedding: Name of the token embedding, if found (its input's sequence length is checked).
        unreduced: Parameter name → why the automatic plan cannot keep it correct (it would get a different gradient
            on each tp rank, which nothing reduces); any entry makes :meth:`validate` refuse the plan.
    """

    styles: dict[str, StyleSpec] = field(default_factory=dict)
    head_attributes: dict[str, dict[str, int]] = field(default_factory=dict)
    checks: list[DivisibilityCheck] = field(default_factory=list)
    unplanned: dict[str, str] = field(default_factory=dict)
    loss_parallel_head: str | None = None
    sequence_parallel: bool = False
    token_embedding: str | None = None
    explicit: bool = False
    unreduced: dict[str, str] = field(default_factory=dict)

    def validate(self, tp: int) -> None:
        """Raise :class:`TensorParallelPlanError` listing every size tp does not divide (and, for sequence
        parallel, modules that would see a slice of the sequence, or a missing token embedding/output head)."""
        problems = [
            f"{c.module}: {c.what} = {c.value} is not divisible by tensor_parallel_size={tp}"
            for c in self.checks
            if c.value % tp
        ]
        if not self.styles:
            raise TensorParallelPlanError(
                "The tensor-parallel plan is empty: no module of the model was recognised as shardable"
                + (f" ({'; '.join(f'{n}: {r}' for n, r in self.unplanned.items())})" if self.unplanned else "")
                + ". Pass an explicit `plan=` mapping module names to styles (colwise, rowwise, ...)."
            )
        if self.sequence_parallel and self.unplanned:
            problems += [
                f"{n}: {r}; with sequence_parallel it would see only this rank's slice of the sequence"
                for n, r in self.unplanned.items()
            ]
        if problems:
            raise TensorParallelPlanError(
                f"Cannot shard the model over tensor_parallel_size={tp}:\n  - "
                + "\n  - ".join(dict.fromkeys(problems))
                + "\nChoose a tensor_parallel_size that divides these sizes, change the model's sizes (pad the"
                " vocabulary to a multiple of tp), or pass an explicit `plan=` that leaves these modules out."
            )
        if self.unreduced and not self.explicit:
            items = "".join(f"\n  - {n}: {r}" for n, r in self.unreduced.items())
            raise TensorParallelPlanError(
                "The automatic tensor-parallel plan cannot shard this model correctly: these parameters would get a"
                f" different gradient on each tp rank and drift apart:{items}\nPass an explicit `plan=` that covers"
                " them (e.g. leave their module replicated, or give it styles whose layouts keep its inputs whole);"
                " `lightning-dist plan --model ...` prints the automatic plan to start from."
            )
        if self.sequence_parallel and not self.explicit:
            head = any(style_name(s) == "colwise" and _input_layout(s) == "shard(1)" for s in self.styles.values())
            if self.token_embedding is None or not head:
                missing = "token embedding" if self.token_embedding is None else "output head"
                raise TensorParallelPlanError(
                    f"sequence_parallel: no {missing} was recognised, so the sequence cannot be split before the"
                    f" first block{'' if missing == 'token embedding' else ' and gathered after the last'}. Pass an"
                    " explicit `plan=` (start from `lightning-dist plan ... --sequence-parallel`), or turn"
                    " sequence_parallel off."
                )

    def compact(self, model: nn.Module) -> dict[str, StyleSpec]:
        """The styles with repeated-block indices folded into ``*`` where every block has the same style."""
        names = [n for n, _ in model.named_modules() if n]
        groups: dict[str, list[str]] = defaultdict(list)
        for name in self.styles:
            groups[re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)].append(name)
        out: dict[str, StyleSpec] = {}
        for pattern, members in groups.items():
            spec = self.styles[members[0]]
            same = all(self.styles[m] == spec for m in members)
            if pattern != members[0] and same and set(match_modules(pattern, names)) == set(members):
                out[pattern] = spec
            else:
                out.update({m: self.styles[m] for m in members})
        return out

    def unplanned_message(self) -> str | None:
        """What was left replicated and how to shard it anyway, or ``None`` when everything was planned."""
        if not self.unplanned:
            return None
        items = "".join(f"\n  - {name}: {reason}" for name, reason in self.unplanned.items())
        return (
            f"The automatic tensor-parallel plan cannot shard these modules; they stay replicated on every tp rank:"
            f"{items}\nTo shard them, pass an explicit `plan=` (module name → colwise/rowwise/...), e.g. after"
            " splitting a fused projection into separate q/k/v Linear layers; `lightning-dist plan --model ...`"
            " prints the automatic plan to start from."
        )

    def summary(self) -> str:
        """One compact line: how many modules of each style and what was left replicated."""
        counts: dict[str, int] = defaultdict(int)
        for spec in self.styles.values():
            counts[spec if isinstance(spec, str) else spec["style"]] += 1
        parts = [f"{n} {style}" for style, n in counts.items()]
        if self.unplanned:
            parts.append(f"left replicated: {', '.join(self.unplanned)}")
        return ", ".join(parts)


def match_modules(pattern: str, names: list[str]) -> list[str]:
    """Module names matching ``pattern`` component by component (``*`` never crosses a dot)."""
    atoms = pattern.split(".")
    return [
        n
        for n in names
        if len(parts := n.split(".")) == len(atoms) and all(fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms))
    ]


def _shard_dim(layout: Any) -> int | None:
    """The dim of a ``"shard(<dim>)"`` layout (string or ``Shard`` placement); ``None`` for anything else."""
    if isinstance(layout, str):
        match = re.fullmatch(r"\s*shard\(\s*(-?\d+)\s*\)\s*", layout, re.IGNORECASE)
        return int(match.group(1)) if match else None
    dim = getattr(layout, "dim", None) if type(layout).__name__ == "Shard" else None
    return dim if isinstance(dim, int) else None


def _input_layout(spec: StyleSpec) -> Any:
    return None if isinstance(spec, str) else spec.get("input_layouts")


def style_name(spec: StyleSpec) -> str:
    return spec if isinstance(spec, str) else str(spec.get("style"))


def normalize_style(spec: StyleSpec, where: str) -> dict[str, Any]:
    """Check a style spec and return it as a dict with a ``"style"`` key."""
    options = {"style": spec} if isinstance(spec, str) else dict(spec)
    style = options.get("style")
    if style not in STYLES:
        raise TensorParallelPlanError(f"plan[{where!r}]: unknown style {style!r}; the styles are {list(STYLES)}.")
    unknown = set(options) - {"style"} - _STYLE_KEYS[style]
    if unknown:
        raise TensorParallelPlanError(
            f"plan[{where!r}]: {style!r} takes {sorted(_STYLE_KEYS[style]) or 'no options'}, not {sorted(unknown)}."
        )
    return options


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
            resolved.styles[name] = spec
            resolved.checks.extend(_size_checks(name, modules[name], options))
            sharded_logits = _shard_dim(options.get("output_layouts")) in (-1, 2)
            if options["style"] == "colwise" and options.get("use_local_output") is False and sharded_logits:
                resolved.loss_parallel_head = name
            if options["style"] == "sequence_parallel":
                resolved.sequence_parallel = True
    order = {n: i for i, n in enumerate(names)}
    resolved.styles = dict(sorted(resolved.styles.items(), key=lambda item: order[item[0]]))
    auto = auto if auto is not None else infer_plan(model)
    resolved.token_embedding = auto.token_embedding if auto.token_embedding in resolved.styles else None
    for attn, attrs in auto.head_attributes.items():
        qkv = [n for n, s in auto.styles.items() if n.startswith(f"{attn}.") and style_name(s) == "colwise"]
        qkv = [n for n in qkv if n.rpartition(".")[2] in _Q + _K + _V]
        if qkv and all(style_name(resolved.styles.get(n, "")) == "colwise" for n in qkv):
            resolved.head_attributes[attn] = attrs
            resolved.checks.extend(c for c in auto.checks if c.module == attn)
    return resolved


def _size_checks(name: str, module: nn.Module, options: dict[str, Any]) -> list[DivisibilityCheck]:
    style = options["style"]
    if isinstance(module, nn.Linear):
        if style == "colwise":
            return [DivisibilityCheck(name, "output features (Linear.out_features)", module.out_features)]
        if style == "rowwise":
            return [DivisibilityCheck(name, "input features (Linear.in_features)", module.in_features)]
    if isinstance(module, nn.Embedding):
        if style == "colwise":
            return [DivisibilityCheck(name, "embedding dim (Embedding.embedding_dim)", module.embedding_dim)]
        if style == "rowwise":
            return [DivisibilityCheck(name, "vocabulary (Embedding.num_embeddings)", module.num_embeddings)]
    if style in ("colwise", "rowwise") and not isinstance(module, (nn.Linear, nn.Embedding)):
        raise TensorParallelPlanError(
            f"plan[{name!r}] = {style!r}, but {name} is a {type(module).__name__}: colwise/rowwise shard nn.Linear"
            " and nn.Embedding only. Name its Linear children instead."
        )
    return []


def _linear_children(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in module.named_children() if type(c) is nn.Linear}


def _pick(linears: dict[str, nn.Linear], candidates: tuple[str, ...]) -> str | None:
    return next((n for n in candidates if n in linears), None)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def infer_plan(model: nn.Module, sequence_parallel: bool = False, loss_parallel: bool = False) -> TensorParallelPlan:
    """Work out the tensor-parallel plan of ``model`` (see the module docstring). Pure inspection; nothing changes.

    Args:
        model: The single-device model.
        sequence_parallel: Shard norms and the residual stream on the sequence dim (dim 1) between the blocks.
        loss_parallel: Leave the output head's logits sharded on the vocabulary for a parallel cross-entropy.
    """
    plan = TensorParallelPlan(sequence_parallel=sequence_parallel)
    grouped: set[str] = set()  # modules whose Linear children a rule claimed
    skipped: list[str] = []  # subtrees not to look into (fused attention)
    checked: set[str] = set()  # attention/MLP modules whose other parameters were checked

    def row_out() -> StyleSpec:  # a fresh dict per entry (shared objects would print as YAML anchors)
        return {"style": "rowwise", "output_layouts": "shard(1)"} if sequence_parallel else "rowwise"

    for name, module in model.named_modules():
        if any(name.startswith(f"{s}.") for s in skipped):
            continue
        if isinstance(module, nn.MultiheadAttention):
            plan.unplanned[name] = (
                "nn.MultiheadAttention keeps query/key/value in one fused in_proj_weight, which column-wise sharding"
                " would split across q/k/v instead of across heads"
            )
            skipped.append(name)
            continue
        if type(module).__name__ == "Conv1D":
            plan.unplanned[name] = "Hugging Face Conv1D (GPT-2 style, transposed weight) is not an nn.Linear"
            continue
        linears = _linear_children(module)
        q, k, v = _pick(linears, _Q), _pick(linears, _K), _pick(linears, _V)
        fused = _pick(linears, _FUSED_QKV)
        if fused is not None and not (q and k and v):
            plan.unplanned[_join(name, fused)] = (
                "fused QKV projection: column-wise sharding would give each rank a slice of [q|k|v] instead of whole"
                " heads"
            )
            grouped.add(name)
            continue
        if q and k and v:
            o = _pick({n: m for n, m in linears.items() if n not in (q, k, v)}, _O)
            if o is None:
                plan.unplanned[name] = f"attention with {q}/{k}/{v} but no recognised output projection"
                continue
            if not _head_count_known(module):
                plan.unplanned[name] = (
                    f"attention with no recognised head-count attribute ({', '.join(Q_HEAD_ATTRIBUTES)}) or head_dim:"
                    " its reshapes could not be adjusted to the per-rank heads"
                )
                grouped.add(name)
                skipped.append(name)
                continue
            _check_extra_parameters(
                plan,
                name,
                module,
                {q, k, v, o},
                "attention heads",
                _attention_sizes(module, linears, q, k, v),
                width=linears[q].in_features,
            )
            for proj in (q, k, v):
                plan.styles[_join(name, proj)] = "colwise"
            plan.styles[_join(name, o)] = row_out()
            if sequence_parallel:
                plan.styles[name] = dict(SEQUENCE_GATHER)
            _attention_checks(plan, name, module, linears[q], linears[k], linears[v], linears[o], o)
            grouped.add(name)
            checked.add(name)
            continue
        ups = [n for n in _UP if n in linears]
        down = _pick({n: m for n, m in linears.items() if n not in ups}, _DOWN)
        if ups and down:
            hidden = {linears[up].out_features for up in ups}
            _check_extra_parameters(
                plan, name, module, {*ups, down}, "MLP hidden units", hidden, width=linears[ups[0]].in_features
            )
            for up in ups:
                plan.styles[_join(name, up)] = "colwise"
                plan.checks.append(DivisibilityCheck(_join(name, up), "MLP hidden size", linears[up].out_features))
            plan.styles[_join(name, down)] = row_out()
            if sequence_parallel:
                plan.styles[name] = dict(SEQUENCE_GATHER)
            grouped.add(name)
            checked.add(name)
            continue
        if "linear1" in linears and "linear2" in linears:  # nn.TransformerEncoderLayer / DecoderLayer
            if sequence_parallel:
                plan.styles[_join(name, "linear1")] = {"style": "colwise", "input_layouts": "shard(1)"}
            else:
                plan.styles[_join(name, "linear1")] = "colwise"
            plan.styles[_join(name, "linear2")] = row_out()
            plan.checks.append(
                DivisibilityCheck(_join(name, "linear1"), "MLP hidden size", linears["linear1"].out_features)
            )
            grouped.add(name)
    _plan_embeddings_and_head(model, plan, grouped, sequence_parallel, loss_parallel)
    if sequence_parallel:
        _plan_norms(model, plan, grouped)
        _check_sequence_parallel_coverage(model, plan, checked)
    _one_name_per_module(model, plan)
    # Keep the model's own order (parents before children), which is also the order printed to users.
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    plan.styles = dict(sorted(plan.styles.items(), key=lambda item: order[item[0]]))
    return plan


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


def _attention_sizes(module: nn.Module, linears: dict[str, nn.Linear], q: str, k: str, v: str) -> set[int]:
    """Sizes of the activations tensor parallelism splits in an attention module: projection widths, head_dim and
    head counts."""
    sizes = {linears[p].out_features for p in (q, k, v)}
    for attr in (*Q_HEAD_ATTRIBUTES, *KV_HEAD_ATTRIBUTES, "head_dim"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            sizes.add(value)
    return sizes


def _attention_checks(
    plan: TensorParallelPlan,
    name: str,
    module: nn.Module,
    q: nn.Linear,
    k: nn.Linear,
    v: nn.Linear,
    o: nn.Linear,
    o_name: str,
) -> None:
    attrs: dict[str, int] = {}
    for group in (Q_HEAD_ATTRIBUTES, KV_HEAD_ATTRIBUTES):
        for attr in group:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                attrs[attr] = value
    for attr in WIDTH_ATTRIBUTES:  # widths used in a reshape back to (batch, seq, heads × head_dim)
        if getattr(module, attr, None) == q.out_features and attrs:
            attrs[attr] = q.out_features
    head_dim = getattr(module, "head_dim", None)
    n_heads = next((attrs[a] for a in Q_HEAD_ATTRIBUTES if a in attrs), None)
    n_kv = next((attrs[a] for a in KV_HEAD_ATTRIBUTES if a in attrs), None)
    if isinstance(head_dim, int) and head_dim > 0:
        n_heads = n_heads or q.out_features // head_dim
        n_kv = n_kv or k.out_features // head_dim
    if n_heads is not None:
        plan.checks.append(DivisibilityCheck(name, "attention heads", n_heads))
    if n_kv is not None and n_kv != n_heads:
        plan.checks.append(DivisibilityCheck(name, "key/value heads (grouped-query attention)", n_kv))
    for proj, what in ((q, "query"), (k, "key"), (v, "value")):
        plan.checks.append(DivisibilityCheck(name, f"{what} projection output features", proj.out_features))
    plan.checks.append(DivisibilityCheck(_join(name, o_name), "attention width (input features)", o.in_features))
    if attrs:
        plan.head_attributes[name] = attrs


def _plan_embeddings_and_head(
    model: nn.Module, plan: TensorParallelPlan, grouped: set[str], sequence_parallel: bool, loss_parallel: bool
) -> None:
    def inside_group(n: str) -> bool:
        return any(n.startswith(f"{g}.") for g in grouped if g)

    embeddings = {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding) and not inside_group(n)}
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear and not inside_group(n)}
    heads = [n for n in linears if n.rpartition(".")[2] in _HEAD and n not in plan.styles]
    token = next((n for n in embeddings if n.rpartition(".")[2] in _TOKEN_EMB), None)
    if token is None and heads:
        vocab = {linears[h].out_features for h in heads}
        token = next((n for n, m in embeddings.items() if m.num_embeddings in vocab), None)
    if token is not None:
        plan.token_embedding = token
        emb = embeddings[token]
        plan.styles[token] = {
            "style": "rowwise",
            "input_layouts": "replicate",
            "output_layouts": "shard(1)" if sequence_parallel else "replicate",
        }
        plan.checks.append(DivisibilityCheck(token, "vocabulary (Embedding.num_embeddings)", emb.num_embeddings))
        heads.sort(key=lambda h: linears[h].out_features != emb.num_embeddings)
        if sequence_parallel:
            # Other embeddings added to the token embedding (learned positions) must be sliced the same way.
            for n, m in embeddings.items():
                if n != token and m.embedding_dim == emb.embedding_dim:
                    plan.styles[n] = {
                        "style": "prepare_output",
                        "output_layouts": "replicate",
                        "desired_output_layouts": "shard(1)",
                    }
    if heads:
        head = heads[0]
        spec: dict[str, Any] = {"style": "colwise"}
        if sequence_parallel:
            spec["input_layouts"] = "shard(1)"
        if loss_parallel:
            spec.update(output_layouts="shard(-1)", use_local_output=False)
            plan.loss_parallel_head = head
        else:
            spec["output_layouts"] = "replicate"
        plan.styles[head] = spec
        plan.checks.append(DivisibilityCheck(head, "vocabulary (Linear.out_features)", linears[head].out_features))


def _plan_norms(model: nn.Module, plan: TensorParallelPlan, grouped: set[str]) -> None:
    """Norms on the residual stream (not inside attention/MLP modules) run on sequence shards."""
    for name, module in model.named_modules():
        if _is_norm(module) and not any(name.startswith(f"{g}.") for g in grouped if g):
            plan.styles[name] = "sequence_parallel"


def _head_count_known(module: nn.Module) -> bool:
    """Whether the attention keeps its query head count (or head_dim) where the plan can adjust or derive it."""
    for attr in (*Q_HEAD_ATTRIBUTES, "head_dim"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return True
    return False


def _check_extra_parameters(
    plan: TensorParallelPlan,
    name: str,
    module: nn.Module,
    sharded: set[str],
    what: str,
    sharded_sizes: set[int],
    width: int,
) -> None:
    """Refuse trainable parameters of an attention/MLP module, outside its sharded Linear layers, that act on the
    sharded activations (a Qwen3-style q_norm/k_norm over head_dim, a scale over the MLP hidden units): each rank
    would compute their gradient from its share of heads or hidden units only, and nothing reduces it.

    Whether a parameter acts on the sharded activations is read from its shape: a dim equal to a sharded size
    (hidden units, projection widths, head_dim, head counts) and not to the model width. Parameters over the model
    width (a norm or an ``nn.MultiheadAttention`` beside ``fc1``/``fc2`` in a block) see the whole, replicated
    activations on every rank; frozen parameters get no gradient. Both are fine.
    """
    ambiguous = sharded_sizes - {width}
    for pname, param in module.named_parameters():
        if pname.split(".")[0] in sharded or not param.requires_grad:
            continue
        # a scalar may scale the sharded activations as well as the whole ones: refused as ambiguous
        if param.numel() == 1 or width in sharded_sizes and width in param.shape or ambiguous.intersection(param.shape):
            plan.unreduced[_join(name, pname)] = (
                f"a parameter of {type(module).__name__} {name!r} outside its sharded Linear layers"
                f" ({', '.join(sorted(sharded))}), of shape {tuple(param.shape)}; it would see only this rank's {what}"
            )


def _check_sequence_parallel_coverage(model: nn.Module, plan: TensorParallelPlan, checked: set[str]) -> None:
    """With sequence parallel, a parameter of a module the plan does not cover sees only this rank's slice of the
    sequence (a layer-scale Parameter on a block, a norm class the plan does not recognise)."""
    covered = set(plan.styles)
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
