"""The context-parallel half of a strategy (a mixin before the shared base): sequence shards, global positions,
the attention dispatch and a Hugging Face causal LM's label shift. Used by ``context_parallel`` and ``hybrid3d``;
everything here is inactive on a mesh whose ``cp`` axis has one rank."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

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
from lightning_dist.parallel.model_structure import recognize

if TYPE_CHECKING:
    from lightning_dist.strategies.base import MeshParallelStrategy

    _Base = MeshParallelStrategy
else:
    _Base = object


class ContextParallelSteps(_Base):
    """Batches sharded on the sequence, global positions and context-parallel attention, when ``cp > 1``."""

    def init_context_parallel(self, attention: str, load_balance: str, sequence_keys: list[str] | None) -> None:
        """Check and keep the context-parallel options (called from the strategy's ``__init__``)."""
        if attention not in ALGORITHMS:
            raise ValueError(f"attention={attention!r} is not one of {list(ALGORITHMS)}.")
        if load_balance not in LAYOUTS:
            raise ValueError(f"load_balance={load_balance!r} is not one of {list(LAYOUTS)}.")
        self.attention = attention
        self.load_balance = "contiguous" if attention == "ulysses" else load_balance
        self.sequence_keys = list(sequence_keys) if sequence_keys is not None else None
        self._keys = parse_sequence_keys(self.sequence_keys) if self.sequence_keys is not None else None
        self._positions: tuple[str, str] | None = None  # (module name, argument)
        self._causal_lm: str | None = None  # a Hugging Face causal LM that shifts its labels itself
        self._explicit_masks = "refuse"
        self._seq_len: int | None = None  # global length of the current batch's sequences
        self._logged_entries: set[tuple[str, ...]] = set()

    @property
    def context_parallel(self) -> bool:
        return self.parallel_dims.cp > 1

    # ------------------------------------------------------------------ the model
    def check_context_parallel_model(self, model: Module) -> None:
        """What can be refused before launch: no positions argument next to a learned position embedding, heads
        that Ulysses cannot split, a Hugging Face attention that does not call SDPA."""
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
            cp, tp = self.parallel_dims.cp, self.parallel_dims.tp
            for name, attn in structure.attention.items():
                for what, count in (("heads", attn.num_heads), ("KV heads", attn.num_kv_heads)):
                    if count is not None and count % (cp * tp):
                        per_tp = f" per tensor-parallel rank (tp={tp})" if tp > 1 else ""
                        raise ValueError(
                            f"attention='ulysses' splits heads over cp={cp}{per_tp}, but {name} has {count} {what}."
                            " Use attention='ring' or 'allgather', or a context_parallel_size dividing the head counts."
                        )
        return structure.positions_argument

    def prepare_context_parallel(self, model: Module) -> None:
        """Find (and log) where the global positions go and whether the model is a causal LM that shifts labels."""
        self._positions = self._find_positions(model)
        where = "" if self._positions is None else f"{self._positions[0] or type(model).__name__}.forward"
        self.log_decision(
            f"global positions passed as {self._positions[1]!r} to {where}"
            if self._positions
            else "no module takes positions (position_ids/input_pos/positions) and no learned position embedding"
            " was found: the model must not depend on absolute positions"
        )
        self._recognize_causal_lm(model)

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
        batch = super().transform_batch(batch, dataloader_idx)
        if not self.context_parallel:
            return batch
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

    def positions_hook(self, module: Module) -> Any:
        """The pre-hook giving ``module`` (the one that takes positions) this rank's global positions."""
        assert self._positions is not None and self._seq_len is not None
        cp, rank = self.parallel_dims.cp, self.mesh["cp"].get_local_rank()
        return fill_positions(module, self._positions[1], self._seq_len, cp, rank, self.load_balance)

    @contextmanager
    def _global_positions(self) -> Generator[None, None, None]:
        """For one step: the positions pre-hook on the module that takes them, then the label-shift pre-hook on a
        Hugging Face causal LM."""
        if not self.context_parallel or self._seq_len is None:
            yield
            return
        handles = []
        if self._positions is not None:
            module = self.lightning_module.get_submodule(self._positions[0])
            handles.append(module.register_forward_pre_hook(self.positions_hook(module), with_kwargs=True))
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
        if self.context_parallel:
            stack.enter_context(self.attention_context())
        return stack

    @override
    def run_training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._global_positions():
            return super().run_training_step(*args, **kwargs)

    @override
    def run_eval_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        if not self.context_parallel:
            return super().run_eval_step(step, *args, **kwargs)
        with self.attention_context(), self._global_positions():
            output = super().run_eval_step(step, *args, **kwargs)
        if step == "predict_step" and self._seq_len is not None and output is not None:
            cp = self.parallel_dims.cp
            output = gather_outputs(output, self._seq_len, cp, self.process_group("cp"), self.load_balance)
        return output
