"""The Fabric strategies, one per Trainer strategy of this package: each applies its Trainer namesake's options, mesh
and parallelization in a Fabric loop (see :class:`~lightning_dist.fabric.strategy.MeshFabricStrategy`)."""

from __future__ import annotations

from typing import Any, NoReturn

from lightning_dist.fabric.strategy import MeshFabricStrategy
from lightning_dist.strategies import (
    ContextParallelStrategy as TrainerContextParallel,
)
from lightning_dist.strategies import (
    FSDP2Strategy as TrainerFSDP2,
)
from lightning_dist.strategies import (
    Hybrid3DStrategy as TrainerHybrid3D,
)
from lightning_dist.strategies import (
    TensorParallelStrategy as TrainerTensorParallel,
)
from lightning_dist.strategies import (
    ZeroPPStrategy as TrainerZeroPP,
)


class FSDP2Strategy(MeshFabricStrategy):
    """FSDP2 (every sharding mode, HSDP, CPU offload, expert parallelism) in a Fabric loop: the options of
    :class:`lightning_dist.FSDP2Strategy`."""

    engine_class = TrainerFSDP2


class ZeroPPStrategy(MeshFabricStrategy):
    """ZeRO++ (qwZ, hpZ, qgZ) in a Fabric loop: the options of :class:`lightning_dist.ZeroPPStrategy`."""

    engine_class = TrainerZeroPP


class TensorParallelStrategy(MeshFabricStrategy):
    """Tensor parallelism with the automatic plan, alone or with FSDP2 (2-D), in a Fabric loop: the options of
    :class:`lightning_dist.TensorParallelStrategy` but ``loss_parallel`` (the loop computes its loss from logits
    whole on every tensor-parallel rank)."""

    engine_class = TrainerTensorParallel


class ContextParallelStrategy(MeshFabricStrategy):
    """Context parallelism in a Fabric loop: the options of :class:`lightning_dist.ContextParallelStrategy`. Each call
    of the model is sharded on the sequence and its outputs gathered back whole, so the loop's loss (labels shifted
    in the loop included) is one process's (see :mod:`lightning_dist.fabric.sequence_shards`)."""

    engine_class = TrainerContextParallel


class Hybrid3DStrategy(MeshFabricStrategy):
    """Any mesh of ``dp_replicate × dp_shard × cp × tp`` (and ep) in a Fabric loop: the options of
    :class:`lightning_dist.Hybrid3DStrategy`, with ``pipeline_parallel_size=1`` and sizes given (``mesh='auto'``
    plans from the model, which a Fabric strategy does not have when the processes start)."""

    engine_class = TrainerHybrid3D

    def __init__(self, **options: Any) -> None:
        if options.get("mesh") == "auto":
            raise ValueError(
                "Hybrid3DStrategy(mesh='auto') under Fabric: the mesh is built at fabric.launch(), before any model"
                " exists to plan it from. Give the sizes (data_parallel_shard_size=..., tensor_parallel_size=...), or"
                " run `lightning-dist plan` on the model and copy its sizes."
            )
        super().__init__(**options)


class PipelineStrategy(MeshFabricStrategy):
    """Refused: see :func:`~lightning_dist.fabric.strategy.MeshFabricStrategy` (a pipeline needs the Trainer)."""

    def __init__(self, **options: Any) -> NoReturn:
        raise ValueError(
            "The pipeline strategies need the Trainer: a pipeline schedule runs forward and backward of every"
            " micro-batch itself, and a Fabric loop has no training step to hand it. Under Fabric use fsdp2, zeropp,"
            " tensor_parallel, context_parallel or hybrid3d without a pipeline axis; or train with"
            " L.Trainer(strategy='pipeline')."
        )
