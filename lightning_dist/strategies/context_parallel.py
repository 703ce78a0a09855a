"""ContextParallelStrategy: the sequence of every batch split over ranks, attention computed over the whole of it."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import ExitStack, contextmanager
from typing import Any

from torch.nn import Module
from typing_extensions import override

from lightning_dist.parallel.attention import ALGORITHMS
from lightning_dist.parallel.context_parallel import LAYOUTS, ContextParallelAttention
from lightning_dist.parallel.context_parallel_batch import (
    fill_positions,
    gather_outputs,
    parse_sequence_keys,
    sequence_entries,
    shard_batch,
)
from lightning_dist.parallel.context_parallel_labels import (
    check_attention_implementation,
    find_causal_lm,
    is_causal_decoder,
    shift_labels_hook,
)
from lightning_dist.parallel.fsdp import FSDPConfig, is_fully_sharded
from lightning_dist.parallel.mesh import ParallelDims, require_split_axis
from lightning_dist.parallel.model_structure import recognize
from lightning_dist.parallel.module_selection import select_modules
from lightning_dist.parallel.parallelize import ParallelizeConfig, parallelize
from lightning_dist.parallel.validation import check_bool
from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize


class ContextParallelStrategy(MeshParallelStrategy):
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
    :mod:`lightning_dist.parallel.context_parallel_labels`), so the loss is the whole sequence's mean however
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
            as ``"a.0.b"``. Default: every tensor whose dim 1 has the sequence length (logged once).
        activation_checkpointing: Recompute the repeated blocks' activations in backward.
    """

    log_name = "context_parallel"

    def __init__(
        self,
        context_parallel_size: MeshSize = "auto",
        data_parallel_shard_size: int = 1,
        attention: str = "ring",
        load_balance: str = "zigzag",
        sequence_keys: list[str] | None = None,
        activation_checkpointing: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if attention not in ALGORITHMS:
            raise ValueError(f"attention={attention!r} is not one of {list(ALGORITHMS)}.")
        if load_balance not in LAYOUTS:
            raise ValueError(f"load_balance={load_balance!r} is not one of {list(LAYOUTS)}.")
        self.context_parallel_size = context_parallel_size
        self.data_parallel_shard_size = data_parallel_shard_size
        self.attention = attention
        self.load_balance = "contiguous" if attention == "ulysses" else load_balance
        self.sequence_keys = list(sequence_keys) if sequence_keys is not None else None
        self._keys = parse_sequence_keys(self.sequence_keys) if self.sequence_keys is not None else None
        self.activation_checkpointing = check_bool("activation_checkpointing", activation_checkpointing)
        self._positions: tuple[str, str] | None = None  # (module name, argument)
        self._causal_lm: str | None = None  # a Hugging Face causal LM that shifts its labels itself
        self._explicit_masks = "refuse"
        self._seq_len: int | None = None  # global length of the current batch's sequences
        self._logged_entries: set[tuple[str, ...]] = set()

    @override
    def mesh_sizes(self) -> dict[str, MeshSize]:
        return {"dp_shard": self.data_parallel_shard_size, "cp": self.context_parallel_size}

    @override
    def validate_mesh(self, dims: ParallelDims) -> None:
        require_split_axis(dims, "cp", "context_parallel_size", "context parallelism")

    # ------------------------------------------------------------------ the model
    @override
    def check_model(self, model: Module) -> None:
        self._find_positions(model)
        self._recognize_causal_lm(model, log=False)

    def _find_positions(self, model: Module) -> tuple[str, str] | None:
        structure = recognize(model)
        if structure.positions_argument is None and structure.other_embeddings:
            raise ValueError(
                f"Context parallel: the model adds a learned position embedding ({', '.join(structure.other_embeddings)})"
                " but no module's forward takes a positions argument (position_ids, input_pos or positions), so each"
                " rank would embed the positions of its shard as if it were the start of the sequence. Give the"
                f" forward of {type(model).__name__} (or the module that indexes the embedding) a `position_ids=None`"
                " argument and use it instead of arange."
            )
        if self.attention == "ulysses":
            cp = self.parallel_dims.cp
            for name, attn in structure.attention.items():
                for what, count in (("heads", attn.num_heads), ("KV heads", attn.num_kv_heads)):
                    if count is not None and count % cp:
                        raise ValueError(
                            f"attention='ulysses' splits heads over cp={cp}, but {name} has {count} {what}. Use"
                            " attention='ring' or 'allgather', or a context_parallel_size dividing the head counts."
                        )
        return structure.positions_argument

    @override
    def parallelize(self, model: Module) -> Module:
        if is_fully_sharded(model):
            raise ValueError(
                "The model's configure_model already applied fully_shard; the context_parallel strategy applies FSDP2"
                " over dp_shard × cp itself. Remove fully_shard from configure_model."
            )
        self._positions = self._find_positions(model)
        where = "" if self._positions is None else f"{self._positions[0] or type(model).__name__}.forward"
        self.log_decision(
            f"global positions passed as {self._positions[1]!r} to {where}"
            if self._positions
            else "no module takes positions (position_ids/input_pos/positions) and no learned position embedding"
            " was found: the model must not depend on absolute positions"
        )
        self._recognize_causal_lm(model)
        dims, root = self.parallel_dims, type(model).__name__
        units = select_modules(model, what="shard")
        config = ParallelizeConfig(
            units=units,
            activation_checkpointing=self.activation_checkpointing,
            fsdp=FSDPConfig(reshard_after_forward=True, mp_policy=self.precision_plugin.mp_policy),
            root_mp_policy=self.precision_plugin.root_mp_policy,
        )
        record = parallelize(model, self.mesh, config)
        if record.checkpointed:
            self.log_decision(f"activation checkpointing on {record.checkpointed}")
        self.log_decision(
            f"{self.attention} attention over cp={dims.cp} ({self.load_balance} layout); FSDP2 over"
            f" dp_shard={dims.dp_shard} × cp={dims.cp} on {record.units} + root {root} (gradients averaged over"
            f" cp), precision={self.precision_plugin.precision}"
        )
        return model

    def _recognize_causal_lm(self, model: Module, log: bool = True) -> None:
        self._causal_lm = find_causal_lm(model)
        if self._causal_lm is None:
            return
        lm = model.get_submodule(self._causal_lm)
        name = self._causal_lm or type(model).__name__
        check_attention_implementation(name, lm)
        if is_causal_decoder(lm):
            self._explicit_masks = "causal"
        if not log:
            return
        self.log_decision(
            f"{name} ({type(lm).__name__}) shifts its labels itself: each step its labels are shifted over the whole"
            " sequence and passed as shift_labels, with num_items_in_batch = non-ignored labels of the sequence / cp;"
            " an attention_mask of ones is passed when the call passes none (no explicit mask is built)"
            + (
                "; a causal mask it builds anyway is computed as causal attention over global positions"
                if self._explicit_masks == "causal"
                else ""
            )
        )

    # ------------------------------------------------------------------ batches and steps
    @override
    def transform_batch(self, batch: Any, dataloader_idx: int = 0) -> Any:
        """Every batch's sequence entries, each checked (divisible by 2·cp or cp) and replaced by this rank's shard."""
        entries, seq_len = sequence_entries(batch, self._keys)
        if tuple(entries) not in self._logged_entries:
            self._logged_entries.add(tuple(entries))
            self.log_decision(f"sharding {sorted(entries)} (sequence length {seq_len}) over cp={self.parallel_dims.cp}")
        cp, rank = self.parallel_dims.cp, self.mesh["cp"].get_local_rank()
        sharded = shard_batch(batch, entries, cp, rank, self.load_balance)
        self._seq_len = seq_len  # only once the batch is known to be valid
        return sharded

    def attention_context(self) -> ContextParallelAttention:
        """The SDPA dispatch of this strategy over its cp group."""
        return ContextParallelAttention(
            self.process_group("cp"), self.attention, self.load_balance, explicit_masks=self._explicit_masks
        )

    @contextmanager
    def _global_positions(self) -> Generator[None, None, None]:
        """For one step: the positions pre-hook on the module that takes them, then the label-shift pre-hook on a
        Hugging Face causal LM."""
        if self._seq_len is None:
            yield
            return
        handles = []
        cp, rank = self.parallel_dims.cp, self.mesh["cp"].get_local_rank()
        if self._positions is not None:
            name, argument = self._positions
            module = self.lightning_module.get_submodule(name)
            hook = fill_positions(module, argument, self._seq_len, cp, rank, self.load_balance)
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        if self._causal_lm is not None:
            lm = self.lightning_module.get_submodule(self._causal_lm)
            hook = shift_labels_hook(lm, self.process_group("cp"), self._seq_len, self.load_balance)
            handles.append(lm.register_forward_pre_hook(hook, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @override
    def train_context(self) -> ExitStack:
        stack = super().train_context()
        stack.enter_context(self.attention_context())
        return stack

    @override
    def run_training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._global_positions():
            return super().run_training_step(*args, **kwargs)

    @override
    def run_eval_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        with self.attention_context(), self._global_positions():
            output = super().run_eval_step(step, *args, **kwargs)
        if step == "predict_step" and self._seq_len is not None:
            cp = self.parallel_dims.cp
            output = gather_outputs(output, self._seq_len, cp, self.process_group("cp"), self.load_balance)
        return output
