"""The context-parallel half of a strategy (a mixin before the shared base): sequence shards, global positions,
the attention dispatch and a Hugging Face causal LM's label shift. Used by ``context_parallel`` and ``hybrid3d``;
everything here is inactive on a mesh whose ``cp`` axis has one rank. Its part in a step is :mod:`.part`'s.

What cannot be split over the sequence is refused: a batch without token sequences before launch when the data can
be read there (else on its first batch), a model whose output loses the sequence dimension (pooled) on its first
step, before any optimizer step."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn import Module

from lightning_dist.parallel.context_parallel.attention import ALGORITHMS
from lightning_dist.parallel.context_parallel.batch import (
    check_entry_lengths,
    fill_positions,
    parse_sequence_keys,
    sequence_entries,
    shard_batch,
)
from lightning_dist.parallel.context_parallel.dispatch import LAYOUTS, ContextParallelAttention
from lightning_dist.parallel.context_parallel.labels import (
    check_attention_implementation,
    find_causal_lm,
    is_causal_decoder,
    shift_labels_hook,
)
from lightning_dist.parallel.context_parallel.outputs import watch_pooled_outputs
from lightning_dist.parallel.context_parallel.rope_tables import global_rope_rows
from lightning_dist.parallel.model_structure import ModelStructure, recognize
from lightning_dist.strategies.lifecycle.first_batch import first_batch
from lightning_dist.strategies.parallelisms.context_parallel.part import ContextParallelPart

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dist.strategies.base import MeshParallelStrategy

    _Base = MeshParallelStrategy
else:
    _Base = object


class ContextParallelSteps(_Base):
    """Batches sharded on the sequence, global positions and context-parallel attention, when ``cp > 1``."""

    declared_parts = (ContextParallelPart,)
    #: What parallelizing learns of the model, taken over by a later Trainer's strategy with the model (see
    #: ``lifecycle/model_handover``): where the global positions go, the rotary tables, a causal LM's label shift.
    parallelized_state = ("_positions", "_rope_tables", "_causal_lm", "_explicit_masks")

    def init_context_parallel(self, attention: str, load_balance: str, sequence_keys: list[str] | None) -> None:
        """Check and keep the context-parallel options (called from the strategy's ``__init__``)."""
        self.warned_sums: set[str] = set()  # names logged as synced sums, warned about once (.logged_sums)
        if attention not in ALGORITHMS:
            raise ValueError(f"attention={attention!r} is not one of {list(ALGORITHMS)}.")
        if load_balance not in LAYOUTS:
            raise ValueError(f"load_balance={load_balance!r} is not one of {list(LAYOUTS)}.")
        self.attention = attention
        self.load_balance = "contiguous" if attention == "ulysses" else load_balance
        self.sequence_keys = list(sequence_keys) if sequence_keys is not None else None
        self._keys = parse_sequence_keys(self.sequence_keys) if self.sequence_keys is not None else None
        self._positions: tuple[str, str] | None = None  # (module name, argument)
        self._rope_tables: tuple[str, tuple[str, ...]] | None = None  # (module name, buffers sliced by length)
        self._outputs_checked: set[str] = set()  # steps whose first call was checked for a pooled output
        self._causal_lm: str | None = None  # a Hugging Face causal LM that shifts its labels itself
        self._explicit_masks = "refuse"
        self._seq_len: int | None = None  # global length of the current batch's sequences
        self._logged_entries: set[tuple[str, ...]] = set()

    @property
    def context_parallel(self) -> bool:
        return self.parallel_dims.cp > 1

    @property
    def positions_argument(self) -> tuple[str, str] | None:
        """The module that takes the positions and its argument's name, once found (set-up)."""
        return self._positions

    @property
    def rope_tables(self) -> tuple[str, tuple[str, ...]] | None:
        """The module whose rotary tables are sliced by the sequence length, and those tables' names."""
        return self._rope_tables

    @property
    def causal_lm(self) -> str | None:
        """The Hugging Face causal LM that shifts its labels itself (its module name), if any."""
        return self._causal_lm

    @property
    def batch_sequence_length(self) -> int | None:
        """The global length of the current batch's sequences, once a batch was sharded."""
        return self._seq_len

    # ------------------------------------------------------------------ the data
    def check_first_batch_before_launch(self, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        """Before launch, the first batch when the entry point's data can be read here: it must hold token
        sequences of a length the layout splits (see :func:`~...lifecycle.first_batch.first_batch`).
        Only the process that launches the others reads it: ranks created elsewhere (torchrun, SLURM) check their
        first batch together after launch instead, so that no rank refuses alone."""
        launching = self.reads_data_before_launch
        if launching and self.mesh_is_known() and self.context_parallel:
            batch = first_batch(arguments, trainer.state.fn.value if trainer.state.fn else "fit")
            if batch is not None:
                entries, _ = sequence_entries(batch, self._keys)
                check_entry_lengths(batch, entries, self.parallel_dims.cp, self.load_balance)

    # ------------------------------------------------------------------ the model
    def check_context_parallel_model(self, model: Module) -> None:
        """What can be refused before launch: no positions argument next to a learned position embedding, a learned
        relative position bias, heads that Ulysses cannot split, a Hugging Face attention that does not call SDPA."""
        self._find_positions(model)
        self._recognize_causal_lm(model, log=False)

    def _find_positions(self, model: Module) -> tuple[str, str] | None:
        structure = recognize(model)
        _check_position_encoding(type(model).__name__, structure)
        self._rope_tables = structure.rope_tables
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
        if self._positions:
            where = f"{self._positions[0] or type(model).__name__}.forward"
            self.log_decision(f"global positions passed as {self._positions[1]!r} to {where}")
        elif self._rope_tables:
            name, tables = self._rope_tables
            owner = name or type(model).__name__
            self.log_decision(
                f"{owner} slices its rotary tables ({'/'.join(tables)}) by the sequence length: for each step they"
                " hold the rows of this rank's global positions"
            )
        else:
            self.log_decision(
                "no module takes positions (position_ids/input_pos/positions) and no learned position embedding"
                " was found: the model must not depend on absolute positions"
            )
        self._recognize_causal_lm(model)

    def leave_labels_to_the_loop(self) -> None:
        """A loop that computes its loss from the gathered logits (Fabric): no label shifting for a causal LM."""
        self._causal_lm = None

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
    def shard_sequences(self, batch: Any) -> Any:
        """Every batch's sequence entries, each checked (divisible by 2·cp or cp) and replaced by this rank's shard."""
        if not self.context_parallel:
            return batch
        cp, rank = self.parallel_dims.cp, self.mesh["cp"].get_local_rank()
        error = None
        try:
            entries, seq_len = sequence_entries(batch, self._keys)
            check_entry_lengths(batch, entries, cp, self.load_balance)
        except ValueError as err:
            if self._seq_len is not None:
                raise
            error = err
        if self._seq_len is None:  # the first batch: if any rank refuses it, every rank raises together
            self._refuse_together(error)
        if tuple(entries) not in self._logged_entries:
            self._logged_entries.add(tuple(entries))
            self.log_decision(f"sharding {sorted(entries)} (sequence length {seq_len}) over cp={cp}")
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
    def global_positions(self) -> Generator[None, None, None]:
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
        with ExitStack() as stack:
            if self._rope_tables is not None:
                cp, rank = self.parallel_dims.cp, self.mesh["cp"].get_local_rank()
                for module in self.rope_modules():
                    rows = global_rope_rows(module, self._rope_tables[1], self._seq_len, cp, rank, self.load_balance)
                    stack.enter_context(rows)
            try:
                yield
            finally:
                for handle in handles:
                    handle.remove()

    def rope_modules(self) -> list[Module]:
        """The modules whose rotary tables are sliced by the length (one per pipeline stage on this rank under
        ``pp``)."""
        return [self.lightning_module.get_submodule(self._rope_tables[0])] if self._rope_tables else []

    @contextmanager
    def first_output_checked(self, step: str) -> Generator[None, None, None]:
        """On the first call of ``step``: refuse a model whose output lost the sequence dimension (see
        :mod:`lightning_dist.parallel.context_parallel.outputs`). Pipelined steps call stages instead: not checked."""
        if step in self._outputs_checked or self._seq_len is None or getattr(self, "pipelined", False):
            yield
            return
        with watch_pooled_outputs(self.lightning_module, self._seq_len, self.parallel_dims.cp, step) as found:
            yield
        self._refuse_together(found[0] if found else None)
        self._outputs_checked.add(step)

    def _refuse_together(self, error: Exception | None) -> None:
        """Every rank learns whether any rank refuses (one all-reduce, on first calls only); if one does, every rank
        raises: its own error, or one naming the refusal of another rank. A refusal that every rank raises is not a
        peer's failure to end this rank for, so the failure watchdog stops first (it would race the rank's own
        error and end its process with status 1)."""
        flag = torch.tensor([0 if error is None else 1], device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        if self._watchdog is not None:
            self._watchdog.stop()
        raise error or ValueError("Context parallel: another rank refused this step (see its error).")


def _check_position_encoding(model_name: str, structure: ModelStructure) -> None:
    """Refuse position encodings that sequence shards would get wrong: a learned relative position bias (added to
    the attention scores, which context-parallel attention does not take), and a learned position embedding that no
    positions argument can index with the shard's global positions."""
    if structure.attention_biases:
        raise ValueError(
            f"Context parallel: {model_name}'s attention adds a learned relative position bias"
            f" ({', '.join(structure.attention_biases)}) to its scores, built from the positions of the tokens it"
            " sees; context-parallel attention computes attention without a bias or mask, so each rank's bias would"
            " be that of its own shard. Train this model with strategy='fsdp2' (data parallel), or use a model with"
            " rotary or absolute position embeddings."
        )
    learned = [*structure.other_embeddings, *structure.position_parameters]
    if structure.positions_argument is None and learned:
        raise ValueError(
            f"Context parallel: the model adds a learned position embedding ({', '.join(learned)}) but no module's"
            " forward takes a positions argument (position_ids, input_pos or positions), so each rank would embed"
            " the positions of its shard as if it were the start of the sequence. Give the forward of"
            f" {model_name} (or the module that indexes the embedding) a `position_ids=None` argument and use it"
            " instead of arange. If the model is not a sequence model (images, sets), context parallelism does"
            " not apply: train it with strategy='fsdp2'."
        )
