"""The data model of a tensor-parallel plan: styles per module, the sizes tp must divide, and their checks.

A plan maps module names to *styles* (plain data: a string or a small dict, so it can live in YAML):

- ``"colwise"``: shard an ``nn.Linear``'s output features (or an ``nn.Embedding``'s embedding dim) over tp ranks.
- ``"rowwise"``: shard an ``nn.Linear``'s input features (or an ``nn.Embedding``'s vocabulary); outputs are summed.
- ``"sequence_parallel"``: run the module (a norm) on the rank's slice of the sequence dim, parameters replicated.
- ``"replicate"``: parameters replicated on every tp rank (as DTensors), inputs and outputs left as they are.
- ``"prepare_input"`` / ``"prepare_output"``: only change the layout of a module's first input / its output.
- ``"fused_colwise"``: shard a fused query/key/value projection by heads; the dict gives the row ``order``
  (``"blocks"``: ``[Q | K | V]``, ``"per_head"``: q, k, v of each head in turn, ``"per_group"``: the query
  heads of each key/value head, then its k and v), ``heads``, ``kv_heads`` and
  ``head_dim``.
- ``"multihead_attention"``: shard an ``nn.MultiheadAttention`` by heads (its ``in_proj`` and ``out_proj``); with
  ``sequence_dim`` (sequence parallel) its inputs and output are this rank's slice of the sequence on that dim.
- ``"fused_gate_up"``: shard a fused ``[gate | up]`` MLP projection (``nn.Linear``) so each rank holds matching rows
  of both halves.
- ``"sharded_dropout"``: an ``nn.Dropout`` whose input is this rank's slice of an activation (``input_layouts``,
  default ``"shard(-1)"``): it draws the whole activation's mask, as one process does, and applies its slice (a LoRA
  adapter's dropout before a row-wise ``lora_A``).

A LoRA-wrapped layer (PEFT) named with ``colwise``/``rowwise``/``fused_*`` is sharded as its base layer: the entry
becomes entries for its ``base_layer``, ``lora_A``, ``lora_B`` and dropout (:mod:`.lora`).

``colwise``/``rowwise`` also take Hugging Face ``Conv1D`` modules (GPT-2).

A dict adds layouts: ``{"style": "colwise", "output_layouts": "shard(-1)", "use_local_output": false}``; layouts
are ``"replicate"`` or ``"shard(<dim>)"``. Keys may use ``*`` for one name component (``"blocks.*.attn.q"``).

The automatic plan is worked out in :mod:`lightning_dist.parallel.tensor_parallel.inference` from what
:mod:`lightning_dist.parallel.model_structure` recognises.
"""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_dist.compat.peft import BASE_LAYER
from lightning_dist.parallel.model_structure import is_conv1d, projection_base, projection_features

StyleSpec = str | dict[str, Any]

STYLES: tuple[str, ...] = (
    "colwise",
    "rowwise",
    "sequence_parallel",
    "replicate",
    "prepare_input",
    "prepare_output",
    "fused_colwise",
    "multihead_attention",
    "fused_gate_up",
    "sharded_dropout",
)
#: Styles that split a layer's output features (a LoRA ``lora_B`` follows its base layer in these).
COLUMN_STYLES: tuple[str, ...] = ("colwise", "fused_colwise", "fused_gate_up")
_STYLE_KEYS = {
    "colwise": {"input_layouts", "output_layouts", "use_local_output"},
    "rowwise": {"input_layouts", "output_layouts", "use_local_output"},
    "sequence_parallel": {"sequence_dim", "use_local_output"},
    "replicate": set(),
    "prepare_input": {"input_layouts", "desired_input_layouts", "use_local_output"},
    "prepare_output": {"output_layouts", "desired_output_layouts", "use_local_output"},
    "fused_colwise": {"order", "heads", "kv_heads", "head_dim", "input_layouts"},
    "multihead_attention": {"sequence_dim"},
    "fused_gate_up": {"input_layouts"},
    "sharded_dropout": {"input_layouts"},
}

SEQUENCE_GATHER: dict[str, Any] = {
    "style": "prepare_input",
    "input_layouts": "shard(1)",
    "desired_input_layouts": "replicate",
}


class TensorParallelPlanError(ValueError):
    """The model cannot be tensor-parallelized as asked; the message names the modules and the numbers."""


@dataclass(frozen=True)
class DivisibilityCheck:
    """``value`` (a size of ``module``) must be divisible by the tp size (or, with ``or_divides``, divide it: key/value
    heads fewer than tp ranks are replicated)."""

    module: str
    what: str
    value: int
    or_divides: bool = False

    def fails(self, tp: int) -> bool:
        return bool(self.value % tp) and not (self.or_divides and tp % self.value == 0)

    def describe(self, tp: int) -> str:
        """The problem, for :meth:`TensorParallelPlan.validate`."""
        return f"{self.module}: {self.what} = {self.value} is not divisible by tensor_parallel_size={tp}" + (
            " and does not divide it" if self.or_divides else ""
        )


@dataclass(frozen=True)
class SharedKVRowsCheck(DivisibilityCheck):
    """With fewer key/value heads than tp ranks, a fused projection's ``[k_g | v_g]`` rows (``value`` = 2·head_dim)
    are split over the ``tp / kv_heads`` ranks sharing head ``g``: they must divide it."""

    kv_heads: int = 1

    def sharers(self, tp: int) -> int:
        return tp // self.kv_heads if self.kv_heads < tp and tp % self.kv_heads == 0 else 1

    def fails(self, tp: int) -> bool:
        return bool(self.value % self.sharers(tp))

    def describe(self, tp: int) -> str:
        return (
            f"{self.module}: {self.what} = {self.value} is not divisible by the {self.sharers(tp)} ranks sharing each"
            f" of the {self.kv_heads} key/value heads at tensor_parallel_size={tp}"
        )


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
        grouped_query: Attention module name → ``{"heads", "kv_heads", "projections"}`` (its key/value projections):
            when tp exceeds the key/value heads, each rank holds the whole key/value projections and computes the
            one head its query heads use (:mod:`lightning_dist.parallel.tensor_parallel.kv_heads`); a fused ``[Q | K | V]``
            projection (no ``projections``) splits each key/value head's rows over the ranks sharing it instead.
        unreduced: Parameter name → why the automatic plan cannot keep it correct (it would get a different gradient
            on each tp rank, which nothing reduces); any entry makes :meth:`validate` refuse the plan.
        partial_over_tp: Parameter name → why each tp rank computes only its part of the gradient (a per-head
            norm, such as Qwen3's ``q_norm``/``k_norm``, applied to this rank's heads): it stays replicated and its
            gradient is summed over tp (:mod:`lightning_dist.parallel.tensor_parallel.partial_gradients`).
        tied: Parameter name → why its tied copies would get different layouts (one module planned, the other
            not); any entry makes :meth:`validate` refuse an automatic plan.
        lora: LoRA-wrapped layer (PEFT) → the style of its base layer, for every wrapped layer sharded as its base
            (its own entries name its children: :mod:`lightning_dist.parallel.tensor_parallel.lora`).
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
    tied: dict[str, str] = field(default_factory=dict)
    partial_over_tp: dict[str, str] = field(default_factory=dict)
    grouped_query: dict[str, dict[str, Any]] = field(default_factory=dict)
    lora: dict[str, str] = field(default_factory=dict)

    def validate(self, tp: int) -> None:
        """Raise :class:`TensorParallelPlanError` listing every size tp does not divide (and, for sequence
        parallel, modules that would see a slice of the sequence, or a missing token embedding/output head)."""
        problems = [c.describe(tp) for c in self.checks if c.fails(tp)]
        problems += [
            f"{name}: a per-head norm in an attention module with {info['kv_heads']} key/value heads; with"
            f" tp={tp}, {tp // info['kv_heads']} ranks hold each key/value head, so a norm on the keys would count"
            " their gradient that many times when it is summed over tp (use a tensor_parallel_size that divides"
            f" {info['kv_heads']}, or an explicit `plan=`)"
            for attention, info in self.grouped_query.items()
            if info["kv_heads"] < tp
            for name in self.partial_over_tp
            if name.startswith(f"{attention}.")
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
                + "\n  - ".join(grouped_by_block(list(dict.fromkeys(problems))))
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
        if self.tied and not self.explicit:
            items = "".join(f"\n  - {n}: {r}" for n, r in self.tied.items())
            raise TensorParallelPlanError(
                f"The automatic tensor-parallel plan cannot shard a tied weight the same way at both ends:{items}\n"
                "Pass an explicit `plan=` that shards both modules over the same dimension (an embedding 'rowwise'"
                " and its tied output projection 'colwise' both shard the vocabulary), or leave both out; or train"
                " this model with fsdp2."
            )
        if self.sequence_parallel and not self.explicit:
            head = any(style_name(s) == "colwise" and input_layout(s) == "shard(1)" for s in self.styles.values())
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
            groups[_fold_indices(name)].append(name)
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
        """One compact line: how many modules of each style (a LoRA-wrapped layer counted once, as its base layer),
        the LoRA-wrapped layers, and what was left whole and why."""
        counts: dict[str, int] = defaultdict(int)
        for name, spec in self.styles.items():
            owner = next((w for w in self.lora if name.startswith(f"{w}.")), None)
            if owner is None or name == f"{owner}.{BASE_LAYER}":
                counts[style_name(spec)] += 1
        parts = [f"{n} {style}" for style, n in counts.items()]
        if self.lora:
            parts.append(_lora_summary(self.lora))
        if self.unplanned:
            parts.append(f"left whole: {_folded_reasons(self.unplanned)}")
        return ", ".join(parts)


def _fold_indices(name: str) -> str:
    """``"layers.3.attn"`` → ``"layers.*.attn"``: every block index replaced by ``*``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


def _lora_summary(lora: dict[str, str]) -> str:
    column = sum(style in COLUMN_STYLES for style in lora.values())
    splits = [
        f"{n} with a {kind} base ({how})"
        for n, kind, how in (
            (column, "column-wise", "lora_B split, lora_A whole"),
            (len(lora) - column, "row-wise", "lora_A split, lora_B whole"),
        )
        if n
    ]
    return f"{len(lora)} LoRA-wrapped layers sharded as their base: {', '.join(splits)}"


def _folded_reasons(unplanned: dict[str, str]) -> str:
    """``"layers.*.attn.q_proj, layers.*.attn.v_proj (why); head (why)"``: names that differ only in block indices
    folded into ``*``, names left whole for the same reason together."""
    by_reason: dict[str, dict[str, None]] = defaultdict(dict)
    for name, reason in unplanned.items():
        by_reason[reason][_fold_indices(name)] = None
    return "; ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())


def fused_kv_checks(name: str, kv_heads: int, head_dim: int, shareable: bool) -> list[DivisibilityCheck]:
    """Checks on the key/value heads of a fused projection: tp divides them, or (``shareable``: a ``[Q | K | V]``
    layout) they divide tp and the ranks sharing one of them split its key and value rows evenly."""
    what = "key/value heads (fused projection)"
    checks = [DivisibilityCheck(name, what, kv_heads, or_divides=shareable)]
    if shareable:
        checks.append(
            SharedKVRowsCheck(name, "key and value rows of one head (2 × head_dim)", 2 * head_dim, kv_heads=kv_heads)
        )
    return checks


def match_modules(pattern: str, names: list[str]) -> list[str]:
    """Module names matching ``pattern`` component by component (``*`` never crosses a dot)."""
    atoms = pattern.split(".")
    return [
        n
        for n in names
        if len(parts := n.split(".")) == len(atoms) and all(fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms))
    ]


def shard_dim(layout: Any) -> int | None:
    """The dim of a ``"shard(<dim>)"`` layout (string or ``Shard`` placement); ``None`` for anything else."""
    if isinstance(layout, str):
        match = re.fullmatch(r"\s*shard\(\s*(-?\d+)\s*\)\s*", layout, re.IGNORECASE)
        return int(match.group(1)) if match else None
    dim = getattr(layout, "dim", None) if type(layout).__name__ == "Shard" else None
    return dim if isinstance(dim, int) else None


def input_layout(spec: StyleSpec) -> Any:
    """The ``input_layouts`` option of a spec (``None`` for a plain string)."""
    return None if isinstance(spec, str) else spec.get("input_layouts")


def style_name(spec: StyleSpec) -> str:
    """The style of a spec, string or dict."""
    return spec if isinstance(spec, str) else str(spec.get("style"))


def normalize_style(spec: StyleSpec, where: str) -> dict[str, Any]:
    """Check a style spec (ours, or a transformers style name: :mod:`.hugging_face`) and return it as a dict with a
    ``"style"`` key."""
    from lightning_dist.parallel.tensor_parallel.hugging_face import from_hugging_face_style, unsupported_style_reason

    if (why := unsupported_style_reason(spec)) is not None:
        raise TensorParallelPlanError(f"plan[{where!r}]: transformers' style {spec!r} cannot be used here: {why}.")
    spec = from_hugging_face_style(spec)
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


def size_checks(name: str, module: nn.Module, options: dict[str, Any]) -> list[DivisibilityCheck]:
    """The sizes of ``module`` that tp must divide for the style ``options`` (refusing styles it cannot take)."""
    style = options["style"]
    module = projection_base(module)  # a LoRA-wrapped layer: the sizes of its base layer
    if style == "fused_colwise":
        heads, kv = int(options["heads"]), int(options["kv_heads"])
        checks = [DivisibilityCheck(name, "attention heads (fused projection)", heads)]
        if kv != heads:
            checks += fused_kv_checks(name, kv, int(options["head_dim"]), options["order"] == "blocks")
        return checks
    if style == "multihead_attention":
        if not isinstance(module, nn.MultiheadAttention):
            raise TensorParallelPlanError(
                f"plan[{name!r}] = 'multihead_attention', but {name} is a {type(module).__name__}, not an"
                " nn.MultiheadAttention."
            )
        return [DivisibilityCheck(name, "attention heads (nn.MultiheadAttention.num_heads)", module.num_heads)]
    if style == "fused_gate_up":
        if type(module) is not nn.Linear or module.out_features % 2:
            raise TensorParallelPlanError(
                f"plan[{name!r}] = 'fused_gate_up', but {name} is not an nn.Linear with an even number of outputs."
            )
        return [
            DivisibilityCheck(name, "MLP hidden size (half of the fused gate/up outputs)", module.out_features // 2)
        ]
    if isinstance(module, nn.Linear) or is_conv1d(module):
        features_in, features_out = projection_features(module)
        kind = "Conv1D" if is_conv1d(module) else "Linear"
        if style == "colwise":
            return [DivisibilityCheck(name, f"output features ({kind}.out_features)", features_out)]
        if style == "rowwise":
            return [DivisibilityCheck(name, f"input features ({kind}.in_features)", features_in)]
    if isinstance(module, nn.Embedding):
        if style == "colwise":
            return [DivisibilityCheck(name, "embedding dim (Embedding.embedding_dim)", module.embedding_dim)]
        if style == "rowwise":
            return [DivisibilityCheck(name, "vocabulary (Embedding.num_embeddings)", module.num_embeddings)]
    if style in ("colwise", "rowwise"):
        raise TensorParallelPlanError(
            f"plan[{name!r}] = {style!r}, but {name} is a {type(module).__name__}: colwise/rowwise shard nn.Linear,"
            " nn.Embedding and Hugging Face Conv1D only. Name its Linear children instead."
        )
    return []


def grouped_by_block(problems: list[str]) -> list[str]:
    """``"name: why"`` lines, those that differ only in the block index of the name given once with the indices
    (``blocks.0–27.attn: attention heads = 28 is not divisible ... (28 modules)``), in first-seen order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for problem in problems:
        name, _, why = problem.partition(": ")
        found = re.search(r"(?:^|\.)(\d+)(?=\.|$)", name)
        key = (name[: found.start(1)] + "{}" + name[found.end(1) :], why) if found else (name.replace("{", "{{"), why)
        groups.setdefault(key, []).append(found.group(1) if found else "")
    lines = []
    for (pattern, why), indices in groups.items():
        if len(indices) == 1:
            lines.append(f"{pattern.format(indices[0])}: {why}")
            continue
        numbers = sorted(int(i) for i in indices)
        span = f"{numbers[0]}–{numbers[-1]}" if numbers == list(range(numbers[0], numbers[-1] + 1)) else ",".join(indices)
        lines.append(f"{pattern.format(span)}: {why} ({len(indices)} modules)")
    return lines
