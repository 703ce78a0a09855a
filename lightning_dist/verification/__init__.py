"""``lightning-dist verify``: does the user's own module train under a strategy as it does in one process?

It trains the module for a few steps under the strategy, and again in one process (the reference) with the same
global batch, the same samples in the same steps (checked) and the same initial weights (copied, not re-seeded),
then compares what each step logged, the gradients, the parameters, the optimizer states, and a checkpoint saved under
the strategy and loaded in one process. See ``docs/verify.md``.

Where things are:
    ``run.py``       the check from start to end (both launches, the checkpoint round trip, the report)
    ``phase.py``     one run, in processes of its own (``python -m lightning_dist.verification.phase``)
    ``recorder.py``  the callback both runs carry: initial weights, the reference's batch, the records
    ``settings.py``  the options, and the Trainer settings both runs get from them
    ``one_process.py``  the reference's strategy in one process (DDP's process group and sampler, no DDP wrapper)
    ``data.py``      the reference's data loaders (the strategy's global batch, on fewer ranks), sample fingerprints
    ``tensors.py``   parameters, gradients and optimizer states read whole, under the user's names
    ``compare.py``   the comparison, as rows; ``causes.py`` the likely cause of a difference
    ``report.py``    :class:`VerifyReport`: the table, the JSON, passed or not
"""

from __future__ import annotations

import copy
import hashlib
import io
import pickle
import sys
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_dist.verification.report import VerifyReport
from lightning_dist.verification.run import VerifyError, run_check
from lightning_dist.verification.settings import ONE_PROCESS, VerifySettings

#: What verify holds a ``float8='tensorwise'`` run to (the reference applies the same conversion): the losses and
#: logged values, relatively. Each rank takes one FP8 scale over its own batch's activations and gradients, one
#: process over the global batch's, so gradients differ by FP8 rounding (6e-2 relative measured, fsdp2, 2 ranks).
#: Rowwise and mxfp8 scales are per row or block, the same either way (gradients within 1e-6 measured, fp32).
FLOAT8_TOLERANCE = 1e-2


def verify(
    model: LightningModule,
    datamodule: LightningDataModule | None = None,
    strategy: str | Strategy = "fsdp2",
    devices: int = 2,
    steps: int = 3,
    *,
    tolerance: float | None = None,
    dtype: str | None = None,
    against: str = ONE_PROCESS,
    keep_dropout: bool = False,
    seed: int = 0,
    workdir: str | None = None,
    timeout: float = 900.0,
    reference_cache: str | None = None,
    anchor: bool = True,
    **trainer_kwargs: Any,
) -> VerifyReport:
    """Check that ``model`` trains under ``strategy`` on ``devices`` processes as it does in one process.

    The runs happen in new processes (as with ``Trainer(devices=N)``), so ``model`` and ``datamodule`` are pickled
    to them: define their classes in an importable module or in the script you run (guarded by
    ``if __name__ == "__main__":``), not in a notebook cell. ``model`` itself is not changed.

    Args:
        model: The LightningModule (its data from its own ``*_dataloader`` hooks unless ``datamodule`` is given).
        datamodule: The data, if not the module's own hooks.
        strategy: The strategy to check: a registered name or an instance.
        devices: Processes (devices) per node of the strategy's run.
        steps: Optimizer steps each run trains.
        tolerance, dtype, against, keep_dropout, seed, workdir, timeout, reference_cache, anchor: As in
            :class:`~lightning_dist.verification.settings.VerifySettings`.
        **trainer_kwargs: Any other ``Trainer`` arguments of the run (``precision``, ``accelerator``,
            ``accumulate_grad_batches``, ``gradient_clip_val``, ...).

    Returns:
        The :class:`VerifyReport`; ``bool(report)`` is whether everything matched within the tolerance.
    """
    settings = VerifySettings(
        steps, tolerance, dtype, against, keep_dropout, workdir, seed, timeout, reference_cache, anchor
    )
    kwargs = {"strategy": strategy, "devices": devices, **trainer_kwargs}
    try:
        objects = pickle.dumps({"model": model, "datamodule": datamodule, "trainer_kwargs": kwargs})
    except Exception as error:  # pickling fails in many ways; all of them end here
        raise VerifyError(
            f"verify runs the model in new processes and could not pickle it ({error}). Define the module's classes"
            " in an importable file and keep unpicklable objects (open files, lambdas) out of its attributes."
        ) from error
    # classes of the running script pickle as __main__.X: the runs import the script first (as multiprocessing does)
    main_path = getattr(sys.modules["__main__"], "__file__", None) if b"__main__" in objects else None
    if main_path is None and b"__main__" in objects:
        raise VerifyError(
            "verify runs the model in new processes, which cannot import classes defined in an interactive session"
            " or notebook. Move the LightningModule (and data) classes into a .py file and import them."
        )
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    stated, extras = strategy_facts(strategy)
    return run_check(
        settings,
        copy.deepcopy(model),
        name,
        str(trainer_kwargs.get("precision", "32-true")),
        {"cli_args": None, "main_path": main_path},
        stated,
        (devices, int(trainer_kwargs.get("num_nodes", 1))),
        objects=objects,
        reference_key=_reference_key(model, datamodule, trainer_kwargs),
        reference_extras=extras,
        initial_weights=getattr(strategy, "initial_weights", None),
    )


def _reference_key(model: LightningModule, datamodule: LightningDataModule | None, trainer_kwargs: dict) -> str:
    """The module, data and Trainer arguments, apart from the strategy's processes (the reference has its own)."""
    kept = {k: v for k, v in trainer_kwargs.items() if k not in ("strategy", "devices", "num_nodes")}
    out = io.BytesIO()
    try:
        _ContentPickler(out).dump((model, datamodule, kept))
    except Exception:  # noqa: BLE001  (unpicklable Trainer arguments: no reuse)
        return ""
    return hashlib.sha256(out.getvalue()).hexdigest()


class _ContentPickler(pickle.Pickler):
    """Pickles a tensor as its dtype, shape and a hash of its values: a tensor's own pickle names its storage's
    memory address, so two identical modules built apart would never share a cached reference."""

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        tensor = obj.detach()
        if tensor.device.type == "meta":
            return ("tensor", str(tensor.dtype), tuple(tensor.shape))
        values = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(values).hexdigest())


def strategy_facts(strategy: str | Strategy | Any) -> tuple[tuple[float, str, tuple[str, ...]] | None, dict[str, Any]]:
    """What verify takes from the strategy (a registered name or an instance): the tolerance it states for itself
    (``verification_tolerance``: ZeRO++'s quantized communication), and what the reference must apply as it does
    (its ``float8`` conversion)."""
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        entry = StrategyRegistry[strategy]
        strategy = entry["strategy"](**entry["init_params"])
    own = getattr(strategy, "verification_tolerance", None)
    stated = own() if callable(own) else None
    extras: dict[str, Any] = {}
    recipe = getattr(strategy, "float8_recipe", None)
    if recipe:
        extras["float8"] = {"recipe": recipe, "skip": list(strategy.float8_skip_patterns)}
    if recipe == "tensorwise":  # rowwise and mxfp8 scale per row or block: the same on each rank as in one process
        why = "float8='tensorwise' scales activations and gradients to FP8 over each rank's own part of the batch"
        stated = _either(stated, (FLOAT8_TOLERANCE, why, ("loss", "logged")))
    return stated, extras


def _either(a: tuple | None, b: tuple) -> tuple[float, str, tuple[str, ...]]:
    """Two stated tolerances at once: the larger, both reasons, what both judge."""
    if a is None:
        return b
    return max(a[0], b[0]), f"{a[1]}; {b[1]}", tuple(q for q in a[2] if q in b[2])


__all__ = ["VerifyError", "VerifyReport", "VerifySettings", "strategy_facts", "verify"]
