"""``lightning-dist plan``: print the tensor-parallel plan the strategy would apply to a model, as YAML.

    lightning-dist plan --model examples.gpt.GPT --tensor-parallel-size 2
    lightning-dist plan --config configs/tensor_parallel.yaml            # model and strategy options from a config
    lightning-dist plan --model my_pkg.Model --init-args '{"n_layer": 2}' --sequence-parallel --loss-parallel

The output is ready to paste under ``trainer.strategy.init_args.plan`` and edit. The model is built on the meta
device (no memory, no weights), so this works for large models on a laptop.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

import yaml

from lightning_dist.commands.errors import CommandError
from lightning_dist.commands.model_arguments import add_model_arguments, build_on_meta, json_object, read_config
from lightning_dist.parallel.tensor_parallel import TensorParallelPlanError, resolve_plan
from lightning_dist.parallel.validation import check_positive_int


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-dist plan", description="Print the automatic tensor-parallel plan of a model as YAML."
    )
    add_model_arguments(parser)
    parser.add_argument("--strategy", default="tensor_parallel", help="only tensor_parallel strategies have a plan")
    parser.add_argument(
        "--tensor-parallel-size", type=_positive_int, default=None, help="check the plan against this size"
    )
    parser.add_argument("--sequence-parallel", action="store_true", default=None)
    parser.add_argument("--loss-parallel", action="store_true", default=None)
    return parser


def _positive_int(text: str) -> int:
    try:
        return check_positive_int("tensor_parallel_size", int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive int (the ranks a layer is split over)") from None


def _from_config(path: str) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
    config = read_config(path)
    model = config.get("model") or {}
    strategy = (config.get("trainer") or {}).get("strategy")
    options: dict[str, Any] = {}
    if isinstance(strategy, dict):
        options = dict(strategy.get("init_args") or {})
    elif isinstance(strategy, str) and strategy.endswith("sequence_parallel"):
        options["sequence_parallel"] = True
    if isinstance(model, str):
        return model, {}, options
    return model.get("class_path"), dict(model.get("init_args") or {}), options


def _fused_split(spec: Any, tp: Any) -> str | None:
    """A comment on how a fused projection is split, or ``None`` for other entries."""
    if spec == "fused_gate_up" or isinstance(spec, dict) and spec.get("style") == "fused_gate_up":
        return (
            "fused [gate|up] split into matching halves (each rank: its rows of gate and of up; rows permuted while"
            " sharded, checkpoints keep the original order)"
        )
    if spec == "multihead_attention" or isinstance(spec, dict) and spec.get("style") == "multihead_attention":
        return "nn.MultiheadAttention split by heads (in_proj by heads, rows permuted; out_proj row-wise)"
    if not isinstance(spec, dict) or spec.get("style") != "fused_colwise":
        return None
    heads, kv, width = spec["heads"], spec["kv_heads"], spec["head_dim"]
    rows = {"blocks": "[Q|K|V]", "per_head": "per-head (q, k, v)"}.get(spec["order"], "per-group (q..., k, v)")
    line = f"fused {rows} split by heads: {heads} q + {kv} kv heads of {width}"
    if isinstance(tp, int) and heads % tp == 0 and kv % tp == 0:
        line += f"; {heads // tp} q + {kv // tp} kv per rank at tp={tp}"
    elif isinstance(tp, int) and heads % tp == 0 and kv < tp and tp % kv == 0:
        line += f"; {heads // tp} q per rank at tp={tp}, each kv head's rows split over the {tp // kv} ranks sharing it"
    if spec["order"] == "blocks":
        line += "; rows permuted into rank order while sharded, checkpoints keep the original order"
    return line


_HELP = ("-h", "--help")


def _help_of_every_planner() -> str:
    """``lightning-dist plan --help``: the three planners, each with its own options."""
    from lightning_dist.commands import plan_mesh, plan_pipeline

    parts = [
        (
            "lightning-dist plan has three planners; the options you give choose one:\n"
            "  --devices N                  rank the meshes of N devices per node for a model (mesh planner)\n"
            "  --strategy pipeline...       print the pipeline stage split (or a config whose strategy is a pipeline)\n"
            "  otherwise                    print the tensor-parallel plan as YAML"
        ),
    ]
    for title, parser in (
        ("mesh planner (--devices)", plan_mesh.build_parser()),
        ("pipeline planner (--strategy pipeline...)", plan_pipeline.build_parser()),
        ("tensor-parallel plan (default)", build_parser()),
    ):
        parts.append(f"=== {title} ===\n{parser.format_help().rstrip()}")
    return "\n\n".join(parts)


def main(argv: list[str]) -> None:
    from lightning_dist.commands import plan_mesh, plan_pipeline

    if plan_mesh.wants_mesh(argv):
        return plan_mesh.main(argv)
    asks_help = any(arg in _HELP for arg in argv)
    if plan_pipeline.wants_pipeline([arg for arg in argv if arg not in _HELP]):
        return plan_pipeline.main(argv)
    if asks_help and not any(arg.startswith(("--strategy", "--config")) for arg in argv):
        print(_help_of_every_planner())
        return None
    args = build_parser().parse_args(argv)
    if not args.strategy.startswith("tensor_parallel") and "TensorParallel" not in args.strategy:
        raise CommandError(f"--strategy {args.strategy}: only the tensor_parallel strategies have a plan to print.")
    class_path, init_args, options = _from_config(args.config) if args.config else (None, {}, {})
    class_path = args.model or class_path
    if class_path is None:
        raise CommandError("Give --model CLASS_PATH or a --config with a model section.")
    init_args.update(json_object(args.init_args))
    for key in ("sequence_parallel", "loss_parallel", "tensor_parallel_size"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    model = build_on_meta(class_path, init_args)
    plan = resolve_plan(
        model, options.get("plan"), bool(options.get("sequence_parallel")), bool(options.get("loss_parallel"))
    )
    tp = options.get("tensor_parallel_size")
    if tp is not None and tp != "auto":
        try:
            check_positive_int("tensor_parallel_size", tp)
        except ValueError as err:
            raise CommandError(str(err)) from None
    header = f"# tensor-parallel plan of {class_path}: {plan.summary()}"
    print(header)
    folded = {re.sub(r"\.\d+(?=\.|$)", ".*", name): attrs for name, attrs in plan.head_attributes.items()}
    for name, attrs in folded.items():
        print(f"# {name}: {', '.join(f'{a}={v}' for a, v in attrs.items())} become the per-rank counts (÷ tp)")
    compact = plan.compact(model)
    for name, spec in compact.items():
        if (line := _fused_split(spec, tp)) is not None:
            print(f"# {name}: {line}")
    if (message := plan.unplanned_message()) is not None:
        print("\n".join(f"# {line}" for line in message.splitlines()))
    print(yaml.safe_dump({"plan": compact}, sort_keys=False, default_flow_style=None).rstrip())
    if isinstance(tp, int):
        try:
            plan.validate(tp)
        except TensorParallelPlanError as err:
            print(f"\n{err}", file=sys.stderr)
            raise SystemExit(1) from None
        print(f"# checked: tensor_parallel_size={tp} divides every sharded size")
