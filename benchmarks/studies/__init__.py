"""One-off measurements behind a docs page each, run by their own command (``python -m benchmarks.<name>``):
:mod:`~benchmarks.studies.pipeline` (bubble, bytes and step time; docs/strategies/pipeline.md),
:mod:`~benchmarks.studies.context_parallel` (activation memory, bytes sent and step time;
docs/strategies/context_parallel.md), :mod:`~benchmarks.studies.float8_parity` (FP8 against no float8;
docs/float8.md), :mod:`~benchmarks.studies.planner_accuracy` (the planner's estimates against real runs;
docs/choosing_a_mesh.md), :mod:`~benchmarks.studies.checkpoint_integrity` (docs/checkpoints.md),
:mod:`~benchmarks.studies.checkpoint_security` (docs/security.md), :mod:`~benchmarks.studies.export_memory`
(docs/export.md), :mod:`~benchmarks.studies.pretrained_load` (host memory of pretrained loads; docs/pretrained.md)
and :mod:`~benchmarks.studies.lora_finetune` (the LoRA loop's steps; docs/finetune.md).

Below, what the tests use of them, under names that say which study each comes from.
"""

from benchmarks.studies.checkpoint_integrity import measure as measure_checksum_cost
from benchmarks.studies.context_parallel import TIMED, TIMED_MODEL, Shape, time_markdown
from benchmarks.studies.context_parallel import measure as measure_context_parallel
from benchmarks.studies.lora_finetune import main as run_lora_finetune
from benchmarks.studies.pipeline import GPT_BIG, bytes_per_rank, measure_bubble
from benchmarks.studies.pipeline import to_markdown as pipeline_markdown
from benchmarks.studies.planner_accuracy import KEYS, estimated
from benchmarks.studies.planner_accuracy import launch as launch_planner_run

__all__ = [
    "GPT_BIG", "KEYS", "TIMED", "TIMED_MODEL", "Shape", "bytes_per_rank", "estimated", "launch_planner_run",
    "measure_bubble", "measure_checksum_cost", "measure_context_parallel", "pipeline_markdown", "run_lora_finetune",
    "time_markdown",
]  # fmt: skip
