"""The router's auxiliary loss across pipeline stages: each stage's routing statistics travel beside the activation.

transformers' MoE models add ``E · Σ_e f_e · P_e`` computed from the router logits of every MoE layer together
(:mod:`lightning_dist.parallel.expert_parallel.router_loss`), but a pipeline stage holds only its own layers. So each
stage records its routers' logits during its forward, adds their statistics (routed rows per expert, router
probability sums, rows) to those received from the previous stage, and sends the sums on as a second boundary tensor
of ``2E + 1`` floats; the last stage adds them to its own layers' before the loss. The probability sums carry
gradient: each stage's routers get the loss's gradient back through the schedule's own backward.

The loss is a product of means, computed once per forward: under a pipeline once per micro-batch, as one process
computes it with gradient accumulation over the same micro-batches (with one micro-batch, exactly one process's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_dist.compat.hugging_face import router_logit_recorders, router_loss_requested
from lightning_dist.parallel.expert_parallel.router_loss import carried_statistics, local_statistics
from lightning_dist.parallel.expert_parallel.structure import experts_per_token, find_expert_layers


class RouterStatisticsCarry:
    """Records one stage's router logits during its forward and gives the statistics to send on.

    Args:
        part: The stage module (its routers are hooked; other stages' units are stand-ins without routers).
        num_experts: Experts per MoE layer (the router logits' width).
        top_k: Experts per token.
        recorders: ``(router class, index of the logits in its output)``, as transformers records them.
    """

    def __init__(self, part: nn.Module, num_experts: int, top_k: int, recorders: list[tuple[type, int]]) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self._logits: list[torch.Tensor] | None = None  # while a stage forward runs
        self._recorded: list[torch.Tensor] = []  # the last forward's
        for module in part.modules():
            for cls, index in recorders:
                if isinstance(module, cls):
                    module.register_forward_hook(self._recorder(index))

    def _recorder(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._logits is not None:  # inside a stage forward (not an activation-checkpoint recompute)
                self._logits.append(output[index] if isinstance(output, (tuple, list)) else output)

        return hook

    @contextmanager
    def running(self, received: torch.Tensor | None, is_last: bool) -> Iterator[None]:
        """Around one stage forward: record the routers; on the last stage, the received sums join the loss."""
        self._logits = []
        try:
            if is_last:
                with carried_statistics(received):
                    yield
            else:
                yield
        finally:
            self._recorded, self._logits = self._logits, None

    def sums(self, received: torch.Tensor | None, model_inputs: dict[str, Any], device: torch.device) -> torch.Tensor:
        """What this (non-last) stage sends on: the received sums plus those of the logits just recorded."""
        mask = model_inputs.get("attention_mask")
        mine = local_statistics(
            tuple(self._recorded), self.num_experts, self.top_k, mask if isinstance(mask, torch.Tensor) else None,
            received.device if received is not None else device,
        )  # fmt: skip
        return mine if received is None else received + mine


@dataclass(frozen=True)
class RouterStatisticsPlan:
    """What the stages need to carry the routing statistics of a model that asks for the auxiliary loss."""

    num_experts: int
    top_k: int
    recorders: list[tuple[type, int]]


def plan_router_statistics(model: nn.Module) -> RouterStatisticsPlan | None:
    """For the pipelined ``model`` before the cut (every MoE layer still in it): a plan when a transformers MoE model
    in it asks for the router's auxiliary loss (``output_router_logits=True``), else ``None``."""
    if router_loss_requested(model) is None:
        return None
    layers = find_expert_layers(model)
    recorders = router_logit_recorders(model)
    top_k = experts_per_token(model, layers[0]) if layers else None
    if not recorders or top_k is None:
        return None
    return RouterStatisticsPlan(layers[0].num_experts, top_k, recorders)


def carry_router_statistics(parts: list[nn.Module], plan: RouterStatisticsPlan) -> None:
    """Give each stage module (:func:`~.stage.cut_pipeline_stages`) a :class:`RouterStatisticsCarry`."""
    for part in parts:
        part.pipeline_runtime.carry = RouterStatisticsCarry(part, plan.num_experts, plan.top_k, plan.recorders)
