"""What every family shares: the one process launcher (:mod:`~benchmarks.common.launch`, with the scenario
convention in :mod:`~benchmarks.common.scenarios` and the process layout in :mod:`~benchmarks.common.layout`), step
timing and memory / communication measuring (:mod:`~benchmarks.common.measure`), the example GPT's sizes
(:mod:`~benchmarks.common.models`), tokens/s, MFU and device peaks (:mod:`~benchmarks.common.hardware`) and folders
laid out as published models (:mod:`~benchmarks.common.published`)."""

from benchmarks.common.hardware import compute_dtype, flops_per_token, lookup_peak, throughput
from benchmarks.common.launch import (
    ROOT,
    child_env,
    failed_ranks,
    free_port,
    rank_env,
    run_command,
    run_ranks,
    run_torchrun_nodes,
    start_ranks,
    stop_processes,
    wait_ranks,
)
from benchmarks.common.layout import Layout
from benchmarks.common.measure import (
    ActivationCounter,
    StepTimer,
    comm_breakdown,
    comm_totals,
    group_label,
    interleaved_order,
    ratio_stats,
    spread,
)
from benchmarks.common.models import SIZES, ModelSize, gpt_parameter_count
from benchmarks.common.published import save_published_folder, save_word_tokenizer
from benchmarks.common.scenarios import run_scenarios, scenario_command

__all__ = [
    "ROOT",
    "SIZES",
    "ActivationCounter",
    "Layout",
    "ModelSize",
    "StepTimer",
    "child_env",
    "comm_breakdown",
    "comm_totals",
    "compute_dtype",
    "failed_ranks",
    "flops_per_token",
    "free_port",
    "gpt_parameter_count",
    "group_label",
    "interleaved_order",
    "lookup_peak",
    "rank_env",
    "ratio_stats",
    "run_command",
    "run_ranks",
    "run_scenarios",
    "run_torchrun_nodes",
    "save_published_folder",
    "save_word_tokenizer",
    "scenario_command",
    "spread",
    "start_ranks",
    "stop_processes",
    "throughput",
    "wait_ranks",
]  # fmt: skip
