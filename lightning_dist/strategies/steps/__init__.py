"""The parts each parallelism contributes to a strategy's steps (:class:`~.part.StepPart`). The order in which they
act is stated in :mod:`lightning_dist.strategies.step_protocol`."""

from lightning_dist.strategies.steps.context_parallel import ContextParallelPart
from lightning_dist.strategies.steps.expert_parallel import ExpertParallelPart
from lightning_dist.strategies.steps.part import StepPart
from lightning_dist.strategies.steps.pipeline import PipelinePart
from lightning_dist.strategies.steps.tensor_parallel import TensorParallelPart

__all__ = ["ContextParallelPart", "ExpertParallelPart", "PipelinePart", "StepPart", "TensorParallelPart"]
