"""A forward-only pass through the pipeline for evaluation and prediction, for any stage placement.

torch 2.13's ``schedule.eval()`` runs the training schedule without backward; on the V placement (ZBV, DualPipeV)
it still performs backward bookkeeping and fails ("can't steal_bwd_input"). This pass needs no torch stage objects:
each rank runs its stages in increasing stage order, every micro-batch in turn (fill-drain, as GPipe), receiving
the activation of the previous stage from its owner and sending its own with a non-blocking send. A rank only ever
waits for a lower stage, so no cycle of waits can form. Each boundary tensor (the activation, and the router's
statistics where a stage sends them too) is preceded by a small header (how many tensors, dtype and shape), so
batches of any shape need no set-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_MAX_DIMS = 8
_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]


def forward_only(
    parts: Sequence[nn.Module],
    stage_ids: Sequence[int],
    num_stages: int,
    owner: Callable[[int], int],
    microbatches: Sequence[dict[str, Any]],
    on_output: Callable[[Any, int], None],
    group: Any = None,
    device: torch.device | str = "cpu",
) -> None:
    """Run every micro-batch through the stages; call ``on_output(stage_output, index)`` on the last stage.

    Args:
        parts: This rank's stage modules.
        stage_ids: Their stage indices.
        num_stages: Stages in the pipeline.
        owner: Pipeline-group rank of a stage index.
        microbatches: The model inputs of each micro-batch (keyword arguments).
        on_output: Receives the last stage's output (its tensors, as the stage returns them) and the micro-batch index.
        group: The pipeline process group (``None``: the world).
        device: Where received activations are placed.
    """
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    local: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    pending: list[tuple[Any, list[torch.Tensor]]] = []
    for stage, part in sorted(zip(stage_ids, parts), key=lambda item: item[0]):
        for index, inputs in enumerate(microbatches):
            if stage == 0:
                output = part(**inputs)
            else:
                previous = owner(stage - 1)
                values = local.pop((stage - 1, index)) if previous == me else _recv(previous, group, device)
                output = part(*values, **inputs)
            if stage == num_stages - 1:
                on_output(output, index)
            elif owner(stage + 1) == me:
                local[(stage, index)] = output if isinstance(output, tuple) else (output,)
            else:
                pending.append(_isend(output, owner(stage + 1), group))
    for works, _keep_alive in pending:
        for work in works:
            work.wait()


def _isend(output: torch.Tensor | tuple[torch.Tensor, ...], peer: int, group: Any) -> tuple[list[Any], list[Any]]:
    tensors = [t.detach().contiguous() for t in (output if isinstance(output, tuple) else (output,))]
    works, keep = [], []
    for tensor in tensors:
        header = torch.full((_MAX_DIMS + 3,), -1, dtype=torch.int64)
        header[0] = len(tensors)
        header[1] = _DTYPES.index(tensor.dtype)
        header[2] = tensor.dim()
        header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        works += [_send(header, peer, group), _send(tensor, peer, group)]
        keep += [header, tensor]
    return works, keep


def _recv(peer: int, group: Any, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    received: list[torch.Tensor] = []
    count = 1
    while len(received) < count:
        header = torch.empty(_MAX_DIMS + 3, dtype=torch.int64)
        _receive(header, peer, group)
        count, dims = int(header[0]), int(header[2])
        shape = [int(d) for d in header[3 : 3 + dims]]
        tensor = torch.empty(shape, dtype=_DTYPES[int(header[1])], device=device)
        _receive(tensor, peer, group)
        received.append(tensor)
    return tuple(received)


def _send(tensor: torch.Tensor, peer: int, group: Any) -> Any:
    return dist.isend(tensor, peer) if group is None else dist.isend(tensor, group=group, group_dst=peer)


def _receive(tensor: torch.Tensor, peer: int, group: Any) -> None:
    work = dist.irecv(tensor, peer) if group is None else dist.irecv(tensor, group=group, group_src=peer)
    work.wait()
