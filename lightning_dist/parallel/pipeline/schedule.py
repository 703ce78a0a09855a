"""Pipeline schedules by name: what each needs, checks made before anything runs, and building torch's schedule.

The names are the snake-case forms of torch 2.13's ``get_schedule_class`` names; torch's own spellings (class names
with or without ``Schedule``, as torchtitan's configs write them) are read too, in any case. The checks repeat torch's own
constraints (and the ones torch only hits mid-run) with messages that name the option, its value and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch.distributed.pipelining.schedules import get_schedule_class

from lightning_dist.parallel.pipeline.split import StagePlacement


@dataclass(frozen=True)
class ScheduleInfo:
    """What a schedule needs.

    Attributes:
        torch_name: The name ``get_schedule_class`` knows.
        multi_stage: Holds several stages per rank (``PipelineScheduleMulti``); single-stage schedules hold one.
        placement: How stage ids map to ranks (``"loop"``: r, r+p, ...; ``"v"``: r and 2p−1−r).
        exact_stages_per_rank: The only allowed number of stages per rank, if fixed.
        needs_microbatches_ge_stages: Fewer micro-batches than stages is refused (1F1B family).
        rounds_divide: The number of micro-batches must be a multiple of ``max(1, m // p)`` (interleaved family).
    """

    torch_name: str
    multi_stage: bool
    placement: StagePlacement = "loop"
    exact_stages_per_rank: int | None = None
    needs_microbatches_ge_stages: bool = False
    rounds_divide: bool = False


SCHEDULES: dict[str, ScheduleInfo] = {
    "gpipe": ScheduleInfo("GPipe", multi_stage=False, exact_stages_per_rank=1),
    "1f1b": ScheduleInfo("1F1B", multi_stage=False, exact_stages_per_rank=1, needs_microbatches_ge_stages=True),
    "interleaved_1f1b": ScheduleInfo("Interleaved1F1B", multi_stage=True, rounds_divide=True),
    "looped_bfs": ScheduleInfo("LoopedBFS", multi_stage=True),
    "interleaved_zero_bubble": ScheduleInfo("InterleavedZeroBubble", multi_stage=True, rounds_divide=True),
    "zbv_zero_bubble": ScheduleInfo("ZBVZeroBubble", multi_stage=True, placement="v", exact_stages_per_rank=2),
    "dualpipev": ScheduleInfo(
        "DualPipeV", multi_stage=True, placement="v", exact_stages_per_rank=2, needs_microbatches_ge_stages=True
    ),
}


def _spelling(name: str) -> str:
    """A schedule name without case, ``_``/``-``/space and a leading ``Schedule``: ``ScheduleInterleaved1F1B``,
    ``Interleaved1F1B``, ``interleaved_1f1b`` and ``interleaved-1f1b`` spell it alike."""
    folded = "".join(c for c in name.lower() if c.isalnum())
    return folded.removeprefix("schedule") or folded


#: Every spelling of a schedule this package reads: its own names, torch's class names and ``get_schedule_class``
#: names (with or without ``Schedule``: torchtitan's ``pipeline_parallel_schedule`` values), in any case.
_SPELLINGS = {_spelling(key): key for key in SCHEDULES} | {_spelling(i.torch_name): key for key, i in SCHEDULES.items()}


def schedule_name(name: str) -> str:
    """This package's name of the schedule ``name`` (see :data:`_SPELLINGS`); refuses an unknown one."""
    found = _SPELLINGS.get(_spelling(name)) if isinstance(name, str) else None
    if found is None:
        torch_names = ", ".join(info.torch_name for info in SCHEDULES.values())
        raise ValueError(
            f"schedule={name!r} is not a pipeline schedule; choose one of {sorted(SCHEDULES)} (torch's class names"
            f" are accepted too: {torch_names}, with or without 'Schedule')."
        )
    return found


def schedule_info(name: str) -> ScheduleInfo:
    """The requirements of schedule ``name`` (any spelling :func:`schedule_name` reads)."""
    return SCHEDULES[schedule_name(name)]


def resolve_stages_per_rank(name: str, stages_per_rank: int | None) -> int:
    """The number of stages each rank holds: 1 for single-stage schedules, 2 by default for the others.

    Raises:
        ValueError: a value the schedule cannot run with.
    """
    info = schedule_info(name)
    if stages_per_rank is None:
        return 1 if not info.multi_stage else 2
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be a positive int, got {stages_per_rank!r}.")
    if info.exact_stages_per_rank is not None and stages_per_rank != info.exact_stages_per_rank:
        raise ValueError(
            f"schedule={name!r} runs exactly {info.exact_stages_per_rank} stage(s) per rank, but"
            f" stages_per_rank={stages_per_rank}. Set stages_per_rank={info.exact_stages_per_rank} or leave it unset"
            + ("" if info.multi_stage else ", or pick 'interleaved_1f1b' or 'looped_bfs' for several stages per rank")
            + "."
        )
    if info.multi_stage and stages_per_rank < 2:
        raise ValueError(
            f"schedule={name!r} interleaves several stages per rank, but stages_per_rank=1. Set stages_per_rank>=2"
            " or use schedule='1f1b' or 'gpipe'."
        )
    return stages_per_rank


#: The schedule whose rule on micro-batches the forward-only pass of evaluation follows (with one stage per rank): any
#: number that divides the batch, since it runs no schedule of torch's.
FORWARD_ONLY_RULE = "gpipe"


def check_n_microbatches(n_microbatches: object) -> None:
    """Refuse a number of micro-batches that is not a positive int (the option's check at construction; the first
    check of :func:`validate_microbatching`)."""
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}.")


def resolve_n_microbatches(
    name: str, batch_size: int, n_microbatches: int | None, pp_size: int, stages_per_rank: int
) -> int:
    """The number of micro-batches of a step, training or evaluation: ``n_microbatches`` when given (validated by
    :func:`validate_microbatching`), else :func:`default_n_microbatches`. Evaluation passes
    :data:`FORWARD_ONLY_RULE` and one stage per rank as its schedule."""
    if n_microbatches is None:
        return default_n_microbatches(name, batch_size, pp_size, stages_per_rank)
    validate_microbatching(name, batch_size, n_microbatches, pp_size, stages_per_rank)
    return n_microbatches


def validate_microbatching(name: str, batch_size: int, n_microbatches: int, pp_size: int, stages_per_rank: int) -> None:
    """Refuse a micro-batch setting the schedule cannot run, before any process starts it.

    Args:
        name: Schedule name.
        batch_size: Samples per pipeline step on one data-parallel replica.
        n_microbatches: Micro-batches per step.
        pp_size: Ranks in the pipeline group.
        stages_per_rank: Stages per rank.
    """
    info = schedule_info(name)
    num_stages = pp_size * stages_per_rank
    check_n_microbatches(n_microbatches)
    if batch_size % n_microbatches != 0:
        raise ValueError(
            f"The per-replica batch size {batch_size} is not divisible by n_microbatches={n_microbatches}. Choose"
            f" n_microbatches from {_divisors(batch_size)} or change the batch size."
        )
    if info.needs_microbatches_ge_stages and n_microbatches < num_stages:
        raise ValueError(
            f"schedule={name!r} needs at least as many micro-batches as stages ({num_stages}), but"
            f" n_microbatches={n_microbatches}. Raise n_microbatches (and the batch size) or use schedule='gpipe'."
        )
    if info.rounds_divide:
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds != 0:
            good = [m for m in _divisors(batch_size) if m % max(1, m // pp_size) == 0]
            raise ValueError(
                f"schedule={name!r} runs micro-batches in rounds of the pipeline size {pp_size}: n_microbatches="
                f"{n_microbatches} must be a multiple of max(1, n_microbatches // {pp_size}) = {rounds}. Use one of"
                f" {good}."
            )


def default_n_microbatches(name: str, batch_size: int, pp_size: int, stages_per_rank: int) -> int:
    """The smallest valid divisor of ``batch_size`` that keeps the bubble of a one-stage-per-rank pipeline near
    one fifth: at least ``4·(p − 1)`` micro-batches, or the largest valid divisor when the batch is too small.

    Raises:
        ValueError: no divisor of the batch size satisfies the schedule (the message lists what would).
    """
    valid = []
    for m in _divisors(batch_size):
        try:
            validate_microbatching(name, batch_size, m, pp_size, stages_per_rank)
        except ValueError:
            continue
        valid.append(m)
    if not valid:
        raise ValueError(
            f"No number of micro-batches dividing the per-replica batch size {batch_size} suits schedule={name!r}"
            f" with {pp_size * stages_per_rank} stages. Use a batch size that is a multiple of"
            f" {pp_size * stages_per_rank}, or schedule='gpipe'."
        )
    target = 4 * (pp_size - 1)
    return next((m for m in valid if m >= target), valid[-1])


def build_schedule(
    name: str,
    stages: Sequence[object],
    n_microbatches: int,
    loss_fn: Callable | None,
    scale_grads: bool = True,
) -> object:
    """Torch's schedule ``name`` over this rank's ``PipelineStage`` objects (one for single-stage schedules)."""
    info = schedule_info(name)
    cls = get_schedule_class(info.torch_name)
    if info.multi_stage:
        return cls(list(stages), n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    if len(stages) != 1:
        raise ValueError(f"schedule={name!r} runs one stage per rank, got {len(stages)} on this rank.")
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def bubble_fraction_formula(name: str, pp_size: int, n_microbatches: int, stages_per_rank: int) -> float:
    """Idle share of the step predicted for equal forward/backward times: ``(p−1)/(m+p−1)`` for one stage per
    rank, ``(p−1)/(v·m + p − 1)`` interleaved (``v`` stages per rank). For the zero-bubble schedules this is the
    interleaved figure, an upper bound: with backward split into equal input- and weight-gradient halves their ideal
    is about 0 (Qi et al., 2024)."""
    v = stages_per_rank if schedule_info(name).multi_stage else 1
    return (pp_size - 1) / (v * n_microbatches + pp_size - 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
