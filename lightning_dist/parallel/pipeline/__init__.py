"""Pipeline parallelism for unchanged models, pure PyTorch (no Lightning import).

The steps a caller (the pipeline strategy, or a plain training loop) takes:

1. :func:`plan_stages` — which units (blocks, embeddings, head) go to which stage; :func:`rehearse_stages` — run
   the stages once on a meta-device copy, before launch, to refuse what the cut cannot follow;
   :func:`stage_ids_for_rank` — which stages this rank holds; :func:`find_tied_parameters` before cutting.
2. :func:`cut_pipeline_stages` — this rank's stage modules, cut from the unchanged model (see :mod:`.stage` for the
   design and its limits); apply FSDP2 / tensor parallel to them; materialise them if the model is on meta.
3. :class:`PipelineRunner` — ``step`` / ``eval`` of a whole batch through a schedule (:mod:`.schedule` checks the
   name and the micro-batching first); :func:`all_reduce_tied_gradients` after ``step``. The optimizers are built
   inside :func:`optimizers_may_be_empty` (a stage may hold nothing to optimize), then :func:`stages_to_optimize`.
4. :func:`capture_call` / :func:`substituted_forward` — run a user's step written for one process: take the model
   call's arguments from it, and on the last stage re-run it per micro-batch with the model call returning the
   pipeline's output.
"""

from lightning_dist.parallel.pipeline.bubble import BusyTimer, bubble_fraction
from lightning_dist.parallel.pipeline.rehearsal import rehearse_stages
from lightning_dist.parallel.pipeline.runner import PipelineRunner
from lightning_dist.parallel.pipeline.schedule import (
    FORWARD_ONLY_RULE,
    SCHEDULES,
    ScheduleInfo,
    bubble_fraction_formula,
    build_schedule,
    check_n_microbatches,
    default_n_microbatches,
    resolve_n_microbatches,
    resolve_stages_per_rank,
    schedule_info,
    schedule_name,
    validate_microbatching,
)
from lightning_dist.parallel.pipeline.split import (
    StagePlan,
    find_pipeline_units,
    find_pipelined_module,
    plan_stages,
    stage_ids_for_rank,
    stage_owner,
)
from lightning_dist.parallel.pipeline.stage import (
    StageCutError,
    cut_pipeline_stages,
    model_inputs_as_kwargs,
    stage_runtime,
)
from lightning_dist.parallel.pipeline.stage_optimizers import (
    EmptyOptimizers,
    StageOptimization,
    optimizers_may_be_empty,
    stages_to_optimize,
)
from lightning_dist.parallel.pipeline.substitution import PipelinedCallError, capture_call, substituted_forward
from lightning_dist.parallel.pipeline.tied import (
    TiedParameter,
    all_reduce_tied_gradients,
    broadcast_tied_parameters,
    count_tied_copies_once,
    find_tied_parameters,
    new_tie_groups,
    tied_layouts_agree,
    tied_parameter_ranks,
)

__all__ = [
    "FORWARD_ONLY_RULE",
    "SCHEDULES",
    "BusyTimer",
    "EmptyOptimizers",
    "PipelineRunner",
    "PipelinedCallError",
    "ScheduleInfo",
    "StageCutError",
    "StageOptimization",
    "StagePlan",
    "TiedParameter",
    "all_reduce_tied_gradients",
    "broadcast_tied_parameters",
    "bubble_fraction",
    "bubble_fraction_formula",
    "build_schedule",
    "capture_call",
    "check_n_microbatches",
    "count_tied_copies_once",
    "cut_pipeline_stages",
    "default_n_microbatches",
    "find_pipeline_units",
    "find_pipelined_module",
    "find_tied_parameters",
    "model_inputs_as_kwargs",
    "new_tie_groups",
    "optimizers_may_be_empty",
    "plan_stages",
    "rehearse_stages",
    "resolve_n_microbatches",
    "resolve_stages_per_rank",
    "schedule_info",
    "schedule_name",
    "stage_ids_for_rank",
    "stage_owner",
    "stage_runtime",
    "stages_to_optimize",
    "substituted_forward",
    "tied_layouts_agree",
    "tied_parameter_ranks",
    "validate_microbatching",
]
