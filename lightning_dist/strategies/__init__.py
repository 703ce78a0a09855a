"""Lightning strategies: adapters from the Trainer's lifecycle to ``lightning_dist.parallel``."""

from lightning_dist.strategies.base import MeshParallelStrategy
from lightning_dist.strategies.context_parallel import ContextParallelStrategy
from lightning_dist.strategies.fsdp2 import FSDP2Strategy
from lightning_dist.strategies.hybrid3d import Hybrid3DStrategy
from lightning_dist.strategies.pipeline import PipelineStrategy
from lightning_dist.strategies.tensor_parallel import TensorParallelStrategy
from lightning_dist.strategies.zeropp import ZeroPPStrategy

__all__ = [
    "ContextParallelStrategy",
    "FSDP2Strategy",
    "Hybrid3DStrategy",
    "MeshParallelStrategy",
    "PipelineStrategy",
    "TensorParallelStrategy",
    "ZeroPPStrategy",
]
