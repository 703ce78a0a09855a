"""``lightning-dist plan --strategy pipeline``: print the stage split the pipeline strategy would make.

    lightning-dist plan --model examples.gpt.GPT --strategy pipeline --pipeline-parallel-size 2
    lightning-dist plan --config configs/pipeline.yaml --pipeline-parallel-size 4
    lightning-dist plan --model my_pkg.Model --strategy pipeline_interleaved --pipeline-parallel-size 2 \
        --split '["blocks.2", "blocks.4", "blocks.6"]'

One line per stage: the rank holding it, its modules and its parameter count. The model is built on the meta device
(no memory, no weights).
"""

from __future__ import annotations

import argparse
from typing import Any

from torch import nn

from lightning_dist.commands.errors import CommandError
from lightning_dist.commands.model_arguments import (
    add_model_arguments,
    build_on_meta,
    json_object,
    json_value,
    read_config,
)
from lightning_dist.parallel import pipeline as pp


def wants_pipeline(argv: list[str]) -> bool:
    """Whether ``lightning-dist plan`` was asked about a pipeline strategy (by ``--strategy`` or the config's)."""
    args, _ = build_parser().parse_known_args(argv)
    if args.strategy is not None:
        return "pipeline" in args.strategy.lower()
    return args.config is not None and "pipeline" in str(_config_strategy(args.config)[0]).lower()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-dist plan", description="Print the pipeline stage split of a model."
    )
    add_model_arguments(parser)
    parser.add_argument("--strategy", default=None, help="pipeline, pipeline_gpipe, pipeline_interleaved, ...")
    parser.add_argument("--pipeline-parallel-size", type=int, default=None, help="ranks in one pipeline")
    parser.add_argument("--schedule", default=None, help="a schedule name (default: the strategy name's)")
    parser.add_argument("--stages-per-rank", type=int, default=None)
    parser.add_argument("--split", default=None, help="JSON: stage-start names, or one list of names per stage")
    return parser


def _config_strategy(path: str) -> tuple[Any, dict[str, Any], Any, dict[str, Any]]:
    """``(strategy name or class path, strategy options, model class path, model options)`` of a config; an
    ``auto`` pipeline size is resolved from ``trainer.devices`` × ``num_nodes`` when those are numbers."""
    config = read_config(path)
    trainer = config.get("trainer") or {}
    strategy = trainer.get("strategy")
    model = config.get("model") or {}
    model_path, model_args = (
        (model, {}) if isinstance(model, str) else (model.get("class_path"), model.get("init_args"))
    )
    name, options = (
        (strategy.get("class_path"), dict(strategy.get("init_args") or {}))
        if isinstance(strategy, dict)
        else (strategy, {})
    )
    world = trainer.get("devices", 1) * trainer.get("num_nodes", 1) if isinstance(trainer.get("devices"), int) else None
    if options.get("pipeline_parallel_size", "auto") == "auto" and world is not None:
        options["pipeline_parallel_size"] = world // int(options.get("data_parallel_shard_size") or 1)
    return name, options, model_path, dict(model_args or {})


def _preset(strategy: str | None) -> dict[str, Any]:
    """The options a registered strategy name presets (``pipeline_gpipe``: ``schedule="gpipe"``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_dist  # noqa: F401  (registers the names)

    if strategy is None or strategy not in StrategyRegistry:
        return {}
    return dict(StrategyRegistry[strategy]["init_params"])


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    strategy, options, class_path, init_args = _config_strategy(args.config) if args.config else (None, {}, None, {})
    options = {**_preset(args.strategy or strategy), **options}
    for key in ("pipeline_parallel_size", "schedule", "stages_per_rank"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.split is not None:
        options["split"] = json_value(args.split, "--split")
    class_path = args.model or class_path
    if class_path is None:
        raise CommandError("Give --model CLASS_PATH or a --config with a model section.")
    size = options.get("pipeline_parallel_size", "auto")
    if not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise CommandError(
            f"pipeline_parallel_size={size!r}: give --pipeline-parallel-size N (N >= 2, the ranks in one pipeline);"
            " 'auto' depends on the number of processes."
        )
    init_args.update(json_object(args.init_args))
    model = build_on_meta(class_path, init_args)
    try:
        for line in describe_pipeline(model, size, options):
            print(line)
    except ValueError as err:
        raise CommandError(str(err)) from None


def describe_pipeline(model: nn.Module, pp_size: int, options: dict[str, Any]) -> list[str]:
    """The lines ``lightning-dist plan`` prints for ``model`` cut into a pipeline of ``pp_size`` ranks."""
    schedule = str(options.get("schedule", "1f1b")).lower()
    info = pp.schedule_info(schedule)
    per_rank = pp.resolve_stages_per_rank(schedule, options.get("stages_per_rank"))
    where = pp.find_pipelined_module(model)
    module = model.get_submodule(where)
    plan = pp.plan_stages(module, pp_size * per_rank, options.get("split", "auto"))
    total = sum(p.numel() for p in model.parameters())
    header = (
        f"# pipeline plan of {type(model).__name__}: {plan.num_stages} stages, schedule {schedule}, pp={pp_size},"
        f" {per_rank} stage(s) per rank (placement {info.placement}), {total:,} parameters"
    )
    lines = [header]
    if where:
        lines.append(f"# pipelined module: {where} ({type(module).__name__}), the module holding every parameter")
    for index, description in enumerate(plan.describe()):
        rank = pp.stage_owner(index, pp_size, info.placement)
        count = sum(p.numel() for u in plan.stages[index] for p in module.get_submodule(u).parameters())
        lines.append(f"{description}  (rank {rank}, {count:,} parameters)")
    for tie in pp.find_tied_parameters(module, plan):
        lines.append(f"# tied across stages (a copy on each, gradients summed): {tie.describe()}")
    return lines
