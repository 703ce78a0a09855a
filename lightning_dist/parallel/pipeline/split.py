"""Which modules go to which pipeline stage, and which stages a rank holds.

A model is cut at *units*: its repeated blocks (``find_repeated_blocks``) and, outside them, the largest submodules
that hold parameters but no block (token embedding, position embedding, final norm, output head). Every parameter
belongs to exactly one unit (a tied parameter may belong to two). Modules without parameters (rotary embeddings,
dropout, metrics) are not units: every stage keeps them, so each stage can recompute what they produce.

``split="auto"`` balances the units over the stages as torchtitan does: each block is one unit of work, everything
before the first block (the embeddings) counts as one block's worth and everything after the last block (norm and
head) as another. A user can instead give the names where stages begin, or the module names of every stage.

"Before" and "after" are the forward's order, found by running it once on a meta-device copy
(:mod:`.order`), not the order in which ``__init__`` registered the modules (litgpt registers its head first).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn

from lightning_dist.parallel.module_selection import find_repeated_blocks
from lightning_dist.parallel.pipeline.order import forward_order

SplitSpec = str | Sequence[str] | Sequence[Sequence[str]]
StagePlacement = Literal["loop", "v"]


@dataclass(frozen=True)
class StagePlan:
    """The units of every stage, in execution order.

    Attributes:
        stages: ``stages[i]`` holds the qualified names of the units of stage ``i``, in forward order.
        blocks: The names of the repeated blocks (a subset of all units), for logging and for sharding per stage.
    """

    stages: tuple[tuple[str, ...], ...]
    blocks: tuple[str, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of(self, unit: str) -> int:
        """The stage holding ``unit``."""
        for index, units in enumerate(self.stages):
            if unit in units:
                return index
        raise KeyError(unit)

    def describe(self) -> list[str]:
        """One line per stage: ``"stage 0: tok_emb, pos_emb, blocks.0-1"``."""
        return [f"stage {i}: {_compact(units)}" for i, units in enumerate(self.stages)]


def find_pipelined_module(model: nn.Module) -> str:
    """The qualified name of the module to pipeline: the innermost module holding every parameter of ``model``
    (``""`` for ``model`` itself). A LightningModule that keeps a Hugging Face model in ``self.model`` pipelines
    ``model``: its ``training_step`` may call ``self.model(...)`` directly or through ``self(...)``."""
    name, module = "", model
    while not any(True for _ in module.parameters(recurse=False)):
        holders = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        if len(holders) != 1 or isinstance(holders[0][1], (nn.ModuleList, nn.ModuleDict)):
            break
        child_name, module = holders[0]
        name = f"{name}.{child_name}" if name else child_name
    return name


def find_pipeline_units(model: nn.Module) -> tuple[list[str], list[str]]:
    """Return ``(units, blocks)``: the qualified names of all units and of the blocks, in the order the forward first
    runs them (:func:`~.order.forward_order`; registration order when no example forward runs on a meta copy).

    Raises:
        ValueError: when a module that contains blocks also owns parameters directly (such a parameter cannot be
            placed on one stage) or when the model has no repeated blocks.
    """
    blocks = [name for name, _ in find_repeated_blocks(model)] or _lone_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (same-class children of an nn.ModuleList or"
            " nn.ModuleDict), so split='auto' cannot balance it. Pass split as a list of module-name lists, one"
            " per stage."
        )
    _refuse_encoder_decoder(model, blocks)
    block_set = set(blocks)
    units: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        direct = [n for n, _ in module.named_parameters(recurse=False)]
        if direct:
            where = prefix or "the root module"
            raise ValueError(
                f"{where} ({type(module).__name__}) holds parameters directly ({', '.join(direct)}) and also"
                " contains pipeline blocks, so its parameters cannot be placed on one stage. Move them into a"
                " submodule."
            )
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if name in block_set:
                units.append(name)
            elif any(b.startswith(f"{name}.") for b in blocks):
                visit(name, child)
            elif any(True for _ in child.parameters()):
                units.append(name)

    visit("", model)
    ordered = forward_order(model, units)
    if ordered is None:
        return units, blocks
    return ordered, [u for u in ordered if u in block_set]


def _lone_blocks(model: nn.Module) -> list[str]:
    """The block of each block list holding a single one (a 1-layer model's ``blocks.0``), outermost lists only:
    such a model has blocks, just too few to repeat, and is told so."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or any(name.startswith(f"{b}.") for b in found):
            continue
        holders = [child for child, c in module.named_children() if any(True for _ in c.parameters())]
        if len(holders) == 1 and len(module) == 1:
            found.append(f"{name}.{holders[0]}" if name else holders[0])
    return found


# Arguments through which a decoder block reads the encoder's output (Hugging Face, torch.nn.TransformerDecoderLayer).
_ENCODER_OUTPUT_ARGUMENTS = frozenset({"encoder_hidden_states", "encoder_outputs", "encoder_output", "memory"})


def _refuse_encoder_decoder(model: nn.Module, blocks: list[str]) -> None:
    """Refuse a model whose blocks form an encoder and a decoder (T5, BART, ``nn.Transformer``): the decoder's blocks
    read the encoder's output besides their own hidden state, and a stage boundary passes one tensor. Told by the
    Hugging Face config, or by block lists of which one reads an encoder's output."""
    lists = list(dict.fromkeys(b.rpartition(".")[0] for b in blocks))
    if len(lists) < 2:
        return
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False) and not any(_reads_encoder_output(model, b) for b in blocks):
        return
    raise ValueError(
        f"{type(model).__name__} is an encoder–decoder model (blocks in {', '.join(f'{n}.*' for n in lists)}):"
        " encoder–decoder models are not supported under pipeline. Its decoder blocks read the encoder's output"
        " besides their own hidden state, but a pipeline stage passes one tensor to the next, so neither"
        " split='auto' nor a hand split can cut it. Use fsdp2 for this model, or pipeline a decoder-only or"
        " encoder-only one."
    )


def _reads_encoder_output(model: nn.Module, block: str) -> bool:
    try:
        parameters = inspect.signature(model.get_submodule(block).forward).parameters
    except (TypeError, ValueError):
        return False
    return not _ENCODER_OUTPUT_ARGUMENTS.isdisjoint(parameters)


def plan_stages(model: nn.Module, num_stages: int, split: SplitSpec = "auto") -> StagePlan:
    """Assign the model's units to ``num_stages`` pipeline stages.

    Args:
        model: The unchanged model (may live on the meta device).
        num_stages: Total number of stages (pipeline size × stages per rank).
        split: ``"auto"``; a list of the unit names where stages 1, 2, ... begin; or one list of module names per
            stage (a name may be a unit or a module that contains whole units, such as ``"blocks"``).

    Raises:
        ValueError: fewer blocks than stages, unknown or partial module names, a unit in two stages or in none.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}.")
    units, blocks = find_pipeline_units(model)
    if isinstance(split, str):
        if split != "auto":
            raise ValueError(f"split={split!r}: expected 'auto', a list of stage-start names or a list of lists.")
        stages = _balanced(units, blocks, num_stages)
    elif all(isinstance(item, str) for item in split):
        stages = _from_starts(units, list(split), num_stages)
    elif all(isinstance(item, (list, tuple)) for item in split):
        stages = _from_lists(units, [list(s) for s in split], num_stages)
    else:
        raise ValueError(f"split={split!r} mixes names and lists; give stage-start names or one list per stage.")
    return StagePlan(tuple(tuple(s) for s in stages), tuple(blocks))


def stage_ids_for_rank(rank: int, pp_size: int, stages_per_rank: int, placement: StagePlacement = "loop") -> list[int]:
    """The stage indices pipeline rank ``rank`` holds.

    ``"loop"``: rank r holds r, r + p, r + 2p, ... (interleaved schedules). ``"v"``: rank r holds r and 2p − 1 − r
    (ZBV and DualPipeV), so the first and last stage share rank 0.
    """
    if not 0 <= rank < pp_size:
        raise ValueError(f"rank {rank} is outside the pipeline group of size {pp_size}.")
    if placement == "loop":
        return [rank + i * pp_size for i in range(stages_per_rank)]
    if placement == "v":
        if stages_per_rank != 2:
            raise ValueError(f"The 'v' stage placement holds exactly 2 stages per rank, got {stages_per_rank}.")
        return [rank, 2 * pp_size - 1 - rank]
    raise ValueError(f"Unknown stage placement {placement!r}; expected 'loop' or 'v'.")


def stage_owner(stage: int, pp_size: int, placement: StagePlacement = "loop") -> int:
    """The pipeline rank holding ``stage`` (inverse of :func:`stage_ids_for_rank`)."""
    if placement == "v":
        return stage if stage < pp_size else 2 * pp_size - 1 - stage
    return stage % pp_size


def _balanced(units: list[str], blocks: list[str], num_stages: int) -> list[list[str]]:
    if len(blocks) < num_stages:
        where = blocks[0] if len(blocks) == 1 else f"{blocks[0].rsplit('.', 1)[0]}.*"
        raise ValueError(
            f"The model has {len(blocks)} block{'s' if len(blocks) > 1 else ''} ({where}) for {num_stages} pipeline"
            " stages: split='auto' gives every stage at least one block. Use fewer stages (pipeline size × stages"
            " per rank), a model with more blocks, or pass split as one list of module names per stage."
        )
    block_set = set(blocks)
    first, last = units.index(blocks[0]), units.index(blocks[-1])
    if any(u not in block_set for u in units[first : last + 1]):
        odd = [u for u in units[first : last + 1] if u not in block_set]
        raise ValueError(
            f"Modules with parameters sit between the blocks ({', '.join(odd)}); split='auto' cannot tell where"
            " they run. Pass split as a list of module-name lists, one per stage."
        )
    # Work items: [everything before the blocks] + blocks + [everything after], the ends weighing one block each.
    items: list[list[str]] = [[b] for b in blocks]
    weights = [1.0] * len(blocks)
    if units[:first]:
        items[0] = units[:first] + items[0]
        weights[0] += 1.0
    if units[last + 1 :]:
        items[-1] = items[-1] + units[last + 1 :]
        weights[-1] += 1.0
    cuts = _min_max_partition(weights, num_stages)
    bounds = [0, *cuts, len(items)]
    return [[u for item in items[bounds[i] : bounds[i + 1]] for u in item] for i in range(num_stages)]


def _min_max_partition(weights: list[float], parts: int) -> list[int]:
    """Cut points splitting ``weights`` into ``parts`` non-empty contiguous groups with the smallest largest sum.

    Among equally good splits the later stages get the lighter load (the last stage also computes the loss).
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest max load placing the first i items into k groups; choice[k][i]: start of the k-th group.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                load = max(best[k - 1][j], prefix[i] - prefix[j])
                if load < best[k][i] or (load == best[k][i] and j > choice[k][i]):
                    best[k][i], choice[k][i] = load, j
    cuts, i = [], n
    for k in range(parts, 0, -1):
        i = choice[k][i]
        cuts.append(i)
    return sorted(cuts)[1:]


def _from_starts(units: list[str], starts: list[str], num_stages: int) -> list[list[str]]:
    if len(starts) != num_stages - 1:
        raise ValueError(
            f"split lists {len(starts)} stage-start names, so it makes {len(starts) + 1} stages, but the pipeline"
            f" has {num_stages}. Give {num_stages - 1} names (where stages 1..{num_stages - 1} begin)."
        )
    unknown = [s for s in starts if s not in units]
    if unknown:
        raise ValueError(f"split names {unknown}, which are not pipeline units of the model. Units: {_compact(units)}.")
    positions = [units.index(s) for s in starts]
    if positions != sorted(set(positions)) or positions[0] == 0:
        raise ValueError(
            f"split={starts}: stage starts must be distinct, in model order and after the first unit"
            f" ({units[0]}). Units: {_compact(units)}."
        )
    bounds = [0, *positions, len(units)]
    return [units[bounds[i] : bounds[i + 1]] for i in range(num_stages)]


def _from_lists(units: list[str], lists: list[list[str]], num_stages: int) -> list[list[str]]:
    if len(lists) != num_stages:
        raise ValueError(f"split gives {len(lists)} stages but the pipeline has {num_stages}; give one list per stage.")
    owner: dict[str, int] = {}
    stages: list[list[str]] = []
    for index, names in enumerate(lists):
        stage: list[str] = []
        for name in names:
            covered = _units_under(units, name)
            if not covered:
                raise ValueError(
                    f"split stage {index} names {name!r}, which is neither a pipeline unit nor a module containing"
                    f" whole units. Units: {_compact(units)}."
                )
            for unit in covered:
                if unit in owner:
                    raise ValueError(
                        f"{unit!r} is in stage {owner[unit]} and in stage {index}; each module goes to one."
                    )
                owner[unit] = index
                stage.append(unit)
        if not stage:
            raise ValueError(f"split stage {index} is empty; every stage needs at least one module.")
        stages.append(stage)
    missing = [u for u in units if u not in owner]
    if missing:
        raise ValueError(f"split leaves {missing} on no stage; every module with parameters must be placed.")
    return stages


def _units_under(units: list[str], name: str) -> list[str]:
    if name in units:
        return [name]
    return [u for u in units if name == "" or u.startswith(f"{name}.")]


def _compact(names: Sequence[str]) -> str:
    """``["blocks.0", "blocks.1", "blocks.2", "ln_f"]`` → ``"blocks.0-2, ln_f"``."""
    parts: list[str] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if run:
            prefix, lo, hi = run[0][0], run[0][1], run[-1][1]
            parts.append(f"{prefix}.{lo}" if lo == hi else f"{prefix}.{lo}-{hi}")
            run.clear()

    for name in names:
        prefix, _, last = name.rpartition(".")
        if last.isdigit() and prefix and run and run[-1][0] == prefix and run[-1][1] + 1 == int(last):
            run.append((prefix, int(last)))
            continue
        flush()
        if last.isdigit() and prefix:
            run.append((prefix, int(last)))
        else:
            parts.append(name)
    flush()
    return ", ".join(parts)
