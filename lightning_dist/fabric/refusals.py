"""What a Fabric loop cannot drive, refused by name when a Fabric strategy is built: the options that act through the
Trainer's loop (set to anything but their default), and a pipeline axis."""

from __future__ import annotations

from typing import Any

#: Options of the Trainer strategies that act through the Trainer's loop, with what to do instead under Fabric
#: (refused only when set to something other than their default).
TRAINER_ONLY: dict[str, tuple[Any, str]] = {
    "on_nonfinite": (
        "ignore",
        "the Trainer's loop skips or stops on a non-finite loss; in a Fabric loop check torch.isfinite(loss) yourself",
    ),
    "accumulation_sync": (
        "every",
        "a Fabric loop chooses when gradients are reduced: wrap the accumulating steps in fabric.no_backward_sync",
    ),
    "fault_tolerance": (None, "fault tolerance restarts the Trainer's loop; train with the Trainer"),
    "log_expert_load": (False, "it logs through the LightningModule; compute the load from your loop"),
    "loss_parallel": (
        False,
        "the loop computes the loss outside the model, from logits that are whole on every tensor-parallel rank",
    ),
}


def refuse_trainer_only(name: str, options: dict[str, Any]) -> None:
    for option, (default, instead) in TRAINER_ONLY.items():
        if option in options and options[option] != default:
            raise ValueError(f"{name}({option}={options[option]!r}) is a Trainer option here: {instead}.")


def refuse_pipeline(name: str, pp: int) -> None:
    if pp > 1:
        raise ValueError(
            f"{name}: the mesh has a pipeline axis (pp={pp}), which a Fabric loop cannot drive: a pipeline schedule"
            " runs forward and backward of every micro-batch itself, and Fabric has no training step to hand it."
            " Keep pipeline_parallel_size=1 under Fabric (fsdp2, tensor_parallel and context_parallel axes all work),"
            " or train with the Trainer's pipeline or hybrid3d strategy."
        )
