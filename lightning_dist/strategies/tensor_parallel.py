"""TensorParallelStrategy: tensor parallelism with a plan the strategy works out, optionally 2D with FSDP2."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor
from torch.nn import Module
from typing_extensions import override

from lightning_dist.parallel.fsdp import is_fully_sharded
from lightning_dist.parallel.mesh import MeshConfigError, ParallelDims, require_split_axis
from lightning_dist.parallel.parallelize import parallelize
from lightning_dist.parallel.validation import check_bool
from lightning_dist.plugins import FullStateCheckpointIO
from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize
from lightning_dist.strategies.parallelisms.tensor_parallel import PlanSpec, TensorParallelSteps


class TensorParallelStrategy(TensorParallelSteps, MeshParallelStrategy):
    """Tensor parallelism (Megatron-style) for an unchanged LightningModule, optionally 2D with FSDP2.

    The strategy inspects the model and shards attention projections (query/key/value column-wise, output row-wise),
    MLPs (up/gate column-wise, down row-wise), the token embedding and the output head over the ``tp`` mesh axis;
    attention modules that keep a head count as an attribute (``n_head``, ``num_key_value_heads``...) get the local
    count. With ``data_parallel_shard_size > 1`` FSDP2 then shards every block and the root over the data-parallel axis
    (TP is applied first); all TP peers of a data-parallel rank get the same batch.

    Args:
        tensor_parallel_size: Ranks a layer is split over (``"auto"``: what the data-parallel size leaves; with both
            ``"auto"``, the devices of one node when there are several nodes, otherwise half the processes).
        data_parallel_shard_size: FSDP2 ranks (``1``: pure tensor parallelism).
        plan: An explicit plan instead of the automatic one: module name (``*`` for one name component) → style
            (``colwise``, ``rowwise``, ``sequence_parallel``, ``replicate``, ``prepare_input``, ``prepare_output``)
            or ``{style: ..., input_layouts: ..., output_layouts: ..., use_local_output: ...}``. Print the automatic
            plan with ``lightning-dist plan`` to start from it.
        sequence_parallel: Norms (and the residual stream between blocks, dropout included) run on a slice of the
            sequence dim; the sequence length must be divisible by the TP size.
        loss_parallel: Keep the output head's logits sharded on the vocabulary in training and compute
            ``F.cross_entropy`` on the shards (no gather of the full logits). Evaluation gets full logits.
        data_parallel_size: Lightning ``ModelParallelStrategy``'s name of ``data_parallel_shard_size``, with its
            meaning (give one of the two).
        save_distributed_checkpoint: As Lightning's ``ModelParallelStrategy``: ``True`` (the default) saves sharded
            checkpoints, ``False`` one file with the full state (:class:`~lightning_dist.FullStateCheckpointIO`).
        **kwargs: The options every strategy takes (``reshard_after_forward``, ``wrap_modules``,
            ``activation_checkpointing``, ``accumulation_sync``, ``compile``...; the FSDP2 ones apply in 2D): see
            :class:`~lightning_dist.strategies.base.MeshParallelStrategy`.
    """

    log_name = "tensor_parallel"

    def __init__(
        self,
        tensor_parallel_size: MeshSize = "auto",
        data_parallel_shard_size: MeshSize = 1,
        plan: PlanSpec | None = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        data_parallel_size: MeshSize | None = None,
        save_distributed_checkpoint: bool = True,
        **kwargs: Any,
    ) -> None:
        if not check_bool("save_distributed_checkpoint", save_distributed_checkpoint):
            kwargs["checkpoint_io"] = kwargs.get("checkpoint_io") or FullStateCheckpointIO()
        super().__init__(**kwargs)
        self.init_tensor_parallel(plan, sequence_parallel, loss_parallel)
        self.tensor_parallel_size = tensor_parallel_size
        self.save_distributed_checkpoint = save_distributed_checkpoint
        if data_parallel_size is not None:
            if data_parallel_shard_size not in (1, data_parallel_size):
                raise MeshConfigError(
                    f"data_parallel_size={data_parallel_size!r} and data_parallel_shard_size="
                    f"{data_parallel_shard_size!r} name the same axis: give one of them."
                )
            data_parallel_shard_size = data_parallel_size
        self.data_parallel_shard_size = data_parallel_shard_size
        #: The option name the data-parallel size was given under, for messages about the mesh.
        self._dp_option = "data_parallel_size" if data_parallel_size is not None else "data_parallel_shard_size"

    @override
    def mesh_sizes(self) -> dict[str, MeshSize]:
        tp, dp = self.tensor_parallel_size, self.data_parallel_shard_size
        if tp == "auto" and dp == "auto":
            world = self.num_processes * self.num_nodes
            if self.num_nodes > 1:
                tp = self.num_processes
            elif world % 2 == 0 and world >= 4:
                tp = world // 2
            else:
                raise MeshConfigError(
                    f"tensor_parallel_size and {self._dp_option} are both 'auto', but {world} processes cannot be"
                    " split into 2 data-parallel groups of at least 2. Set tensor_parallel_size."
                )
        return {"dp_shard": dp, "tp": tp}

    @property
    def data_parallel_size(self) -> MeshSize:
        """Lightning ``ModelParallelStrategy``'s name of :attr:`data_parallel_shard_size`."""
        return self.data_parallel_shard_size

    @override
    def validate_mesh(self, dims: ParallelDims) -> None:
        require_split_axis(dims, "tp", "tensor_parallel_size", "tensor parallelism")

    # ------------------------------------------------------------------ parallelizing
    @override
    def check_model(self, model: Module) -> None:
        if is_fully_sharded(model) or any(isinstance(p, DTensor) for p in model.parameters()):
            return  # parallelized by the model's own code: parallelize() decides
        self.tensor_parallel_plan(model).validate(self.parallel_dims.tp)

    @override
    def parallelize(self, model: Module) -> Module:
        if is_fully_sharded(model):
            if not _sharded_over_tensor_parallel(model):
                raise ValueError(
                    "The model's configure_model already applied fully_shard but no tensor parallelism;"
                    " tensor parallelism has to be applied before FSDP2. Remove fully_shard from configure_model"
                    " (the strategy applies FSDP2 for data_parallel_shard_size > 1), or apply parallelize_module"
                    " before it, as for Lightning's ModelParallelStrategy."
                )
            self.log_decision(
                "the model's configure_model applied its own tensor parallelism and fully_shard (as for Lightning's"
                " ModelParallelStrategy); keeping them as they are: no plan and no FSDP2 of the strategy's"
            )
            return model
        plan = None
        if any(isinstance(p, DTensor) for p in model.parameters()):
            self.log_decision(
                "the model's configure_model already applied tensor parallelism (it has DTensor parameters);"
                " keeping it as it is, no plan applied"
            )
        else:
            plan = self.tensor_parallel_plan(model)
        blocks, root = self.shard_units(model), type(model).__name__
        config = self.standard_parallelize_config(blocks, plan)
        record = parallelize(model, self.mesh, config)
        if plan is not None:
            self.log_tensor_parallel_plan(model, plan, record.tp_changes)
        self.log_layout(config, record, root, label="2D: FSDP2")
        return model


def _sharded_over_tensor_parallel(model: Module) -> bool:
    """Whether a parameter of ``model`` is a DTensor over the tensor-parallel axis (by our name or Lightning's)."""
    names = {"tp", "tensor_parallel"}
    return any(isinstance(p, DTensor) and names & set(p.device_mesh.mesh_dim_names or ()) for p in model.parameters())
