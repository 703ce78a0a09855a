"""ContextParallelStrategy: the sequence of every batch split over ranks, attention computed over the whole of it."""

from __future__ import annotations

from typing import Any

from torch.nn import Module
from typing_extensions import override

from lightning_dist.parallel.fsdp import is_fully_sharded
from lightning_dist.parallel.mesh import ParallelDims, require_split_axis
from lightning_dist.parallel.parallelize import parallelize
from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize
from lightning_dist.strategies.parallelisms.context_parallel.sequence_shards import ContextParallelSteps


class ContextParallelStrategy(ContextParallelSteps, MeshParallelStrategy):
    """Context parallelism for an unchanged LightningModule: each rank holds ``1/cp`` of every sequence.

    The strategy shards every sequence tensor of each batch (training, validation, test, predict) in the attention's
    layout, passes the model the *global* positions of its shard (to the outermost module whose ``forward`` takes
    ``position_ids``/``input_pos``/``positions``, when the caller passes none), routes every
    ``F.scaled_dot_product_attention`` to context-parallel attention from forward to the end of backward, and
    shards the model with FSDP2 over ``dp_shard × cp`` so gradients are averaged over cp. Predict outputs whose
    dim 1 is a shard are gathered back to the whole sequence.

    Labels must be aligned per position in the batch (shifting them inside ``training_step`` would cross shard
    boundaries), except for a Hugging Face causal LM given ``labels`` (``model(input_ids=x, labels=x)``): the
    strategy shifts those over the whole sequence and passes ``shift_labels`` and ``num_items_in_batch`` (see
    :mod:`lightning_dist.parallel.context_parallel.labels`), so the loss is the whole sequence's mean however
    unevenly ``-100`` labels fall on the shards; the causal mask such a model builds from zigzag positions is
    computed as causal attention over global positions (a padding ``attention_mask`` or packed ``position_ids`` are
    refused). A loss computed in ``training_step`` from labels aligned per position is each shard's mean: equal to
    the whole sequence's mean only when every shard counts the same number of labels.

    Args:
        context_parallel_size: Ranks a sequence is split over (``"auto"``: what ``data_parallel_shard_size`` leaves).
        data_parallel_shard_size: Data-parallel ranks (each sees different samples); FSDP2 shards over both.
        attention: ``"ring"`` (K/V passed around the group), ``"allgather"`` (K/V all-gathered, as Llama 3) or
            ``"ulysses"`` (all-to-all over heads: heads and KV heads divisible by cp).
        load_balance: ``"zigzag"`` (sequence length divisible by 2·cp; balanced causal work) or ``"contiguous"``
            (divisible by cp). Ulysses is always contiguous.
        sequence_keys: Batch entries that carry the sequence, ``"name"`` (dim 1) or ``"name:dim"``; nested entries
            as ``"a.0.b"``. Default: the sequence length is dim 1 of the first token sequence (an integer
            ``[batch, sequence]`` tensor: token ids, labels), and every tensor whose dim 1 has that length is split
            (logged once). A batch without token sequences (images, sets, feature vectors) is refused unless its
            sequence entries are named here.
        **kwargs: The options every strategy takes (``reshard_after_forward``, ``wrap_modules``,
            ``activation_checkpointing``, ``accumulation_sync``, ``compile``...): see
            :class:`~lightning_dist.strategies.base.MeshParallelStrategy`.
    """

    log_name = "context_parallel"

    def __init__(
        self,
        context_parallel_size: MeshSize = "auto",
        data_parallel_shard_size: int = 1,
        attention: str = "ring",
        load_balance: str = "zigzag",
        sequence_keys: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.init_context_parallel(attention, load_balance, sequence_keys)
        self.context_parallel_size = context_parallel_size
        self.data_parallel_shard_size = data_parallel_shard_size

    @override
    def mesh_sizes(self) -> dict[str, MeshSize]:
        return {"dp_shard": self.data_parallel_shard_size, "cp": self.context_parallel_size}

    @override
    def validate_mesh(self, dims: ParallelDims) -> None:
        require_split_axis(dims, "cp", "context_parallel_size", "context parallelism")

    @override
    def check_model(self, model: Module) -> None:
        self.check_context_parallel_model(model)

    @override
    def parallelize(self, model: Module) -> Module:
        if is_fully_sharded(model):
            raise ValueError(
                "The model's configure_model already applied fully_shard; the context_parallel strategy applies FSDP2"
                " over dp_shard × cp itself. Remove fully_shard from configure_model."
            )
        self.prepare_context_parallel(model)
        dims, root = self.parallel_dims, type(model).__name__
        config = self.standard_parallelize_config(self.shard_units(model))
        record = parallelize(model, self.mesh, config)
        self.log_layout(
            config, record, root, extras=[f"{self.attention} attention over cp={dims.cp} ({self.load_balance} layout)"]
        )
        return model
