"""A rehearsal of the stage cut before any process exists: every stage's forward, run once on a meta-device copy.

What the cut cannot follow (a forward that reads another stage's module, units running out of the split's order, a
value other than the hidden state crossing a boundary) otherwise shows on the ranks, after launch, in the stage's
first forward. The same forwards run here, in one process, on a parameter-free copy: no memory, no compute. The
whole model's forward runs first on the same inputs; only when it runs and a stage's does not is the cut to blame,
so a forward that cannot run on the meta device at all (it reads tensor values, say) is simply not rehearsed.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_dist.parallel.pipeline.order import _to_meta, _token_examples, meta_twin, on_meta
from lightning_dist.parallel.pipeline.router_statistics import carry_router_statistics, plan_router_statistics
from lightning_dist.parallel.pipeline.split import StagePlan
from lightning_dist.parallel.pipeline.stage import StageCutError, cut_pipeline_stages

_PACKAGE = Path(__file__).resolve().parents[2]  # lightning_dist/
_TORCH = Path(torch.__file__).resolve().parent


def rehearse_stages(model: nn.Module, plan: StagePlan, inputs: dict[str, Any] | None = None) -> bool:
    """Run every stage of ``plan`` in order on a meta-device copy of ``model``, the activation passed between them.

    Args:
        model: The unchanged pipelined module (it is not run or changed: a meta copy is).
        plan: Its stage plan (:func:`~.split.plan_stages`).
        inputs: The pipelined call's keyword arguments (from the first batch); default: example token ids as the
            forward's first argument.

    Returns:
        Whether a rehearsal ran (``False``: no input on which the whole forward runs on the meta device).

    Raises:
        StageCutError: a stage's forward fails where the whole forward runs; the message is the one the ranks would
            have raised, with the line of the model's code that failed.
    """
    examples = [((), inputs)] if inputs is not None else _token_examples(model)
    for _, kwargs in examples:  # keyword arguments only, as stages take them
        kwargs = _to_meta(kwargs)
        if not _runs_whole(model, kwargs):
            continue
        twin = meta_twin(model)
        statistics = plan_router_statistics(twin)
        parts = cut_pipeline_stages(twin, plan, list(range(plan.num_stages)), "meta")
        if statistics is not None:
            carry_router_statistics(parts, statistics)
        received: tuple[torch.Tensor, ...] = ()
        for stage, part in enumerate(parts):
            try:
                with on_meta(grad=True):
                    output = part(*received, **kwargs)
            except Exception as err:  # whatever the cut makes fail (the whole forward ran) is refused
                raise _refusal(plan, stage, err) from err
            outputs = output if isinstance(output, tuple) else (output,)
            received = tuple(o.detach().requires_grad_(o.is_floating_point()) for o in outputs)
            received = received if stage < len(parts) - 1 else ()
        return True
    return False


def _runs_whole(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the whole forward runs on the meta device, with autograd on as the stages run (a model may take
    another path with it: transformers' gradient checkpointing turns the key/value cache off, and its mask code then
    reads tensor values)."""
    try:
        with on_meta(grad=True):
            meta_twin(model)(**kwargs)
    except Exception:  # noqa: BLE001 (this forward cannot run on the meta device: nothing to compare with)
        return False
    return True


def _refusal(plan: StagePlan, stage: int, err: Exception) -> StageCutError:
    where = _model_code_line(err)
    text = str(err) if isinstance(err, (StageCutError, AttributeError)) else f"{type(err).__name__}: {err}"
    if not text.startswith("Pipeline stage"):
        text = (
            f"Pipeline stage {stage} ({', '.join(plan.stages[stage])}) fails when the model is cut into stages:"
            f" {text} Pass split= as one list of module names per stage, or use another parallelism for this model."
        )
    return StageCutError(f"{text} (Found before launch, on a meta-device copy{where}.)")


def _model_code_line(err: BaseException) -> str:
    """``", at modeling_vit.py:368 in forward: expected_dtype = ..."``: the innermost frame of neither this package
    nor torch, where the model's code met the cut."""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        path = Path(frame.filename).resolve()
        if not path.is_relative_to(_PACKAGE) and not path.is_relative_to(_TORCH):
            code = f": {frame.line}" if frame.line else ""
            return f", at {path.name}:{frame.lineno} in {frame.name}{code}"
    return ""
