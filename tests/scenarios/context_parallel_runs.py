"""ContextParallelStrategy in a real Trainer: the unchanged example GPT (which builds ``arange`` positions itself when
it gets none) trained at cp=2 with each attention algorithm, against one process on the whole sequence (fp64).

python tests/scenarios/context_parallel_runs.py --devices 1 --out r.json --workdir DIR --scenarios reference
python tests/scenarios/context_parallel_runs.py --devices 2 --out r.json --workdir DIR --scenarios ring,allgather,...
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
import torch
from common import StepRecorder, full_state, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]

from lightning_dist import ContextParallelStrategy

STEPS = 4


def _trainer(devices: int, strategy: Any, recorder: StepRecorder) -> L.Trainer:
    return L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true", callbacks=[recorder]),
        max_steps=STEPS,
        val_check_interval=STEPS,
    )


def _run(devices: int, strategy: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[torch.Tensor]]:
    model, data = make_model_and_data(devices, dp_size=1)
    recorder = StepRecorder()
    trainer = _trainer(devices, strategy, recorder)
    trainer.fit(model, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    predictions = trainer.predict(model, dataloaders=data.val_dataloader())
    result = {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "val": metrics}
    return result, full_state(model), [p.cpu() for p in predictions[:2]]


def reference(devices: int, workdir: str) -> dict[str, Any]:
    """One process, the whole sequence: what every cp run must match."""
    result, state, predictions = _run(devices, "auto")
    torch.save({"state": state, "predictions": predictions}, f"{workdir}/reference.pt")
    return result


def context_parallel(devices: int, workdir: str, **options: Any) -> dict[str, Any]:
    strategy = (WithoutPositions if options.pop("control", False) else ContextParallelStrategy)(**options)
    result, state, predictions = _run(devices, strategy)
    expected = torch.load(f"{workdir}/reference.pt")
    result["param_diff"] = max((state[k] - v).abs().max().item() for k, v in expected["state"].items())
    result["same_keys"] = sorted(state) == sorted(expected["state"])
    result["prediction_shapes"] = [list(p.shape) for p in predictions]
    result["predictions_equal"] = all(torch.equal(p, q) for p, q in zip(predictions, expected["predictions"]))
    result["positions"] = strategy._positions
    return result


class WithoutPositions(ContextParallelStrategy):
    """The control: the model builds its own (local) positions, as it would without the strategy's pre-hook."""

    def _find_positions(self, model: torch.nn.Module) -> None:
        super()._find_positions(model)


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "reference": reference,
    "ring": partial(context_parallel, attention="ring"),
    "allgather_checkpointed": partial(context_parallel, attention="allgather", activation_checkpointing=True),
    "ulysses": partial(context_parallel, attention="ulysses"),
    "without_positions": partial(context_parallel, attention="ring", control=True),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
