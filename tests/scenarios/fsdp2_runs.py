"""FSDP2 scenarios: parity with one process for each sharding mode, and precision checks (checkpoints: checkpoint_runs.py).

python tests/scenarios/fsdp2_runs.py --devices 2 --out r.json --workdir DIR --scenarios full,grad_op
python tests/scenarios/fsdp2_runs.py --devices 1 --out ref.json --workdir DIR   # the one-process reference
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import (  # type: ignore[import-not-found]
    StepRecorder,
    full_state,
    is_rank_zero,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback

from lightning_dist import FSDP2Precision, FSDP2Strategy
from lightning_dist.profiling import CommCounter, state_bytes

STEPS = 6
ACCUMULATE = 2
CLIP = 0.5


def strategy_for(devices: int, **kwargs: Any) -> Any:
    return FSDP2Strategy(**kwargs) if devices > 1 else "auto"


def train(devices: int, workdir: str, name: str, precision: str = "64-true", **strategy_kwargs: Any) -> dict[str, Any]:
    """Fit STEPS optimizer steps with accumulation and clipping, then validate."""
    model, data = make_model_and_data(devices)
    recorder = StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy_for(devices, **strategy_kwargs), precision=precision),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        callbacks=[recorder],
    )
    trainer.fit(model, data)
    bytes_local = state_bytes(model, trainer.optimizers)
    held = bytes_local["parameters"] + bytes_local["gradients"] + bytes_local["optimizer_state"]
    metrics = trainer.validate(model, data, verbose=False)[0]
    metrics.update(trainer.test(model, data, verbose=False)[0])
    predictions = trainer.predict(model, data)
    params = full_state(model)
    if is_rank_zero():
        torch.save(params, f"{workdir}/{name}_d{devices}.pt")
    return {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "val": {k: float(v) for k, v in metrics.items()},
        "state_bytes_max_rank": max_over_ranks(held),
        "predicted_tokens": sum_over_ranks(sum(p.numel() for p in predictions)),
        "post_forward_meshes": len(_post_forward_meshes(model)),
    }


def _post_forward_meshes(model: torch.nn.Module) -> set[int]:
    """Distinct post-forward meshes of the units that reshard to a smaller group after forward (int reshard)."""
    from lightning_dist.parallel.fsdp import fsdp_modules

    meshes = set()
    for module in fsdp_modules(model):
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None and group._use_post_forward_mesh:
            meshes.add(id(group.post_forward_mesh_info.mesh))
    return meshes


def max_over_ranks(value: int) -> int:
    return _all_reduce_int(value, dist.ReduceOp.MAX) if dist.is_initialized() else value


def sum_over_ranks(value: int) -> int:
    return _all_reduce_int(value, dist.ReduceOp.SUM) if dist.is_initialized() else value


def _all_reduce_int(value: int, op: dist.ReduceOp) -> int:
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=op)
    return int(t.item())


def bf16_dtypes(devices: int, workdir: str) -> dict[str, Any]:
    """bf16-mixed: which dtypes parameters have at rest, in forward and in the gradient reduction."""
    model, data = make_model_and_data(devices)
    seen: dict[str, str] = {}

    def record(module: torch.nn.Module, args: tuple) -> None:
        seen["forward_weight"] = str(module.weight.dtype)
        seen["forward_input"] = str(args[0].dtype)

    model.blocks[0].attn.query.register_forward_pre_hook(record)
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy_for(devices), precision="bf16-mixed"), max_steps=2)
    with CommCounter() as counter:
        trainer.fit(model, data)
    plugin = trainer.strategy.precision_plugin
    return {
        "plugin": type(plugin).__name__,
        "at_rest": sorted({str(p.dtype) for p in model.parameters()}),
        "at_rest_local": sorted({str(p.to_local().dtype) for p in model.parameters()}),
        "grad": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
        **seen,
        "reduce_dtypes": sorted({str(r.dtype) for r in counter.records if "reduce_scatter" in r.op}),
        # FSDP2's parameter all-gathers (the step's other all-gathers carry flags and objects: int and byte tensors)
        "all_gather_dtypes": sorted({str(r.dtype) for r in counter.records if "all_gather_into_tensor" in r.op}),
    }


class _OverflowOnLastRank(Callback):
    """Puts an inf into one gradient shard of the last rank only, on the first step."""

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == 0 and trainer.global_rank == trainer.world_size - 1:
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            grad.to_local().view(-1)[0] = float("inf")


def fp16_loss_scaling(devices: int, workdir: str) -> dict[str, Any]:
    """16-mixed: an overflow on one rank must skip the step on every rank, then training goes on."""
    model, data = make_model_and_data(devices)
    plugin = FSDP2Precision("16-mixed")
    before = full_state(model)
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy_for(devices), plugins=[plugin]),
        max_steps=1,
        callbacks=[_OverflowOnLastRank()],
    )
    trainer.fit(model, data)
    after_skip = full_state(model)
    unchanged = all(torch.equal(before[k], after_skip[k]) for k in before)
    skipped = [plugin.scaler.skipped_steps]
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, skipped[0])
        skipped = gathered
    recorder = StepRecorder()
    trainer2 = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy_for(devices), plugins=[FSDP2Precision("16-mixed")]),
        max_steps=8,
        callbacks=[recorder],
    )
    trainer2.fit(model, data)
    return {
        "skipped_per_rank": skipped,
        "params_unchanged_after_skip": unchanged,
        "scale": plugin.scaler.scale_value,
        "losses": recorder.losses,
    }


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "full": lambda d, w: train(d, w, "full", sharding="full"),
    "grad_op": lambda d, w: train(d, w, "grad_op", sharding="grad_op"),
    "no_shard": lambda d, w: train(d, w, "no_shard", sharding="no_shard"),
    "hybrid": lambda d, w: train(d, w, "hybrid", sharding="hybrid", data_parallel_replicate_size=2),
    "full_fp32": lambda d, w: train(d, w, "full_fp32", precision="32-true", sharding="full"),
    "int_reshard": lambda d, w: train(d, w, "int_reshard", sharding="full", reshard_after_forward=2),
    "activation_checkpointing": lambda d, w: train(d, w, "activation_checkpointing", activation_checkpointing=True),
    "bf16_dtypes": bf16_dtypes,
    "fp16_loss_scaling": fp16_loss_scaling,
}


if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
