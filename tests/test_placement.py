"""Where a parallelized model's state goes. The meta device stands in for the accelerator, so the decision that
broke ``fsdp2_cpu_offload`` on CUDA (parameters outside the blocks moved to the GPU) is checked on a CPU machine."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dist.parallel.placement import place_model, planned_devices

CPU, ACCELERATOR = torch.device("cpu"), torch.device("meta")


def _model() -> nn.Module:
    # embedding and head outside the repeated blocks, norms with buffers inside them: the layout that broke
    return nn.Sequential(nn.Embedding(16, 8), nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), nn.Linear(8, 16))


def test_offload_keeps_every_parameter_on_the_cpu_and_moves_buffers():
    model = _model()
    plan = planned_devices(model, ACCELERATOR, offload_parameters=True)
    assert {n for n, d in plan.items() if d == CPU} == {n for n, _ in model.named_parameters()}
    assert {n for n, d in plan.items() if d == ACCELERATOR} == {n for n, _ in model.named_buffers()}
    place_model(model, ACCELERATOR, offload_parameters=True)
    assert all(p.device == CPU for p in model.parameters())  # 0.weight and 2.weight included
    assert all(b.device == ACCELERATOR for b in model.buffers())


def test_without_offload_everything_moves():
    model = _model()
    assert set(planned_devices(model, ACCELERATOR, offload_parameters=False).values()) == {ACCELERATOR}
    place_model(model, ACCELERATOR, offload_parameters=False)
    assert all(t.device == ACCELERATOR for t in [*model.parameters(), *model.buffers()])


def test_offload_moves_a_torchmetrics_metric_whose_states_are_plain_attributes():
    """A LightningModule's metric has no parameters; its states move only through its own ``to()`` (the CUDA
    offload test's validation step failed with 'cuda:0 and cpu' before)."""
    from torchmetrics.classification import MulticlassAccuracy

    model = nn.ModuleDict({"body": _model(), "accuracy": MulticlassAccuracy(num_classes=4)})
    place_model(model, ACCELERATOR, offload_parameters=True)
    assert all(p.device == CPU for p in model.parameters())
    assert model["accuracy"].tp.device == ACCELERATOR and model["accuracy"].device == ACCELERATOR
