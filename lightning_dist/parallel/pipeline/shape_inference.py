"""torch's shape inference of a pipeline stage, kept from changing the model or tripping the user's checks.

On the first step of a schedule torch runs every stage module once, forward and backward, to learn the shapes
that cross stages: the first stage on the batch, later stages on tensors made with ``torch.empty`` (whatever values
the memory held). That rehearsal used to leave traces a one-process run has not:

* buffers a forward updates took its values: BatchNorm's running statistics counted one batch more, and on later
  stages averaged in uninitialized memory (a running mean of 5.5e17 after two steps);
* under ``Trainer(detect_anomaly=True)`` the rehearsal's backward reported NaN ("Function 'LogSoftmaxBackward0'
  returned nan values") in a model that had none.

So the rehearsal runs with anomaly detection off and the stage module's buffers put back afterwards; the real
steps see the user's settings and the model's own state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_dist.compat import wrap_stage_shape_inference


def isolate_shape_inference(stage: object, module: nn.Module) -> None:
    """Make ``stage``'s shape inference (a torch ``PipelineStage`` running ``module``) leave no trace: the buffers
    are saved before its forward and those it changed put back after its backward (in between, autograd holds
    them)."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    @contextmanager
    def without_traces(phase: str) -> Iterator[None]:
        if phase != "backward":
            saved[:] = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
        try:
            with torch.autograd.set_detect_anomaly(False):
                yield
        finally:
            if phase != "forward":
                with torch.no_grad():
                    for buffer, value in saved:
                        if not _same(buffer, value):  # an unchanged buffer is left alone (see below)
                            buffer.copy_(value)
                saved.clear()

    wrap_stage_shape_inference(stage, without_traces)


def _same(buffer: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``buffer`` still holds ``value`` (NaN where it held NaN). Writing it back anyway would bump its version:
    stages on one rank share their root's buffers (litgpt's rotary cache), and under an interleaved schedule another
    stage's rehearsal forward, whose backward is still to run, has saved them."""
    if torch.equal(buffer, value):
        return True
    if not buffer.is_floating_point():
        return False
    return torch.equal(buffer.isnan(), value.isnan()) and torch.equal(buffer.nan_to_num(), value.nan_to_num())
