"""Context parallelism in a Fabric loop, where the loop, not the strategy, computes the loss.

A Fabric loop hands the model whole sequences and computes its loss from the output, often shifting the labels itself
(litgpt: ``logits[..., :-1]`` against ``targets[..., 1:]``). So the sharding happens at the model's call instead of
in the data: a forward pre-hook on the root replaces every sequence tensor of the call by this rank's shard (as the
Trainer strategy shards a batch), opens the step's contexts (attention over the cp group, the shard's global
positions or rotary rows), and a forward hook gathers the sequence outputs back whole (through autograd: see
:func:`~lightning_dist.parallel.context_parallel.batch.gather_outputs`). The loop's loss is then one process's, on
every cp rank. The contexts stay open until the strategy's ``backward`` ends (recomputation under activation
checkpointing needs them); a call without gradients closes them at its end.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from lightning_dist.compat.hugging_face import packed_sequences_not_detected
from lightning_dist.parallel.context_parallel.batch import gather_outputs

if TYPE_CHECKING:
    from lightning_dist.strategies.context_parallel import ContextParallelStrategy


class FabricSequenceShards:
    """The hooks on ``root`` that shard each call's sequences over cp and gather its outputs back whole.

    Args:
        engine: The context-parallel strategy whose options, mesh and set-up decisions (positions, rotary tables,
            attention) apply.
        root: The model Fabric calls.
    """

    def __init__(self, engine: ContextParallelStrategy, root: Module) -> None:
        self.engine = engine
        self.root = root
        self._step: ExitStack | None = None
        self._step_length: int | None = None
        engine.leave_labels_to_the_loop()  # the loop computes the loss from the gathered logits; `labels` are refused
        self._handles: list[RemovableHandle] = [
            root.register_forward_pre_hook(self._shard, with_kwargs=True, prepend=True),
            root.register_forward_hook(self._gather, with_kwargs=True),
        ]

    def _shard(self, module: Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("labels") is not None:
            raise ValueError(
                "Under context parallelism in a Fabric loop the model's outputs are gathered back to whole sequences"
                " and the loop computes the loss: call the model without `labels` and compute the loss from its"
                " logits (as litgpt's loops do), or train with the Trainer's context_parallel strategy, which shifts"
                " a Hugging Face model's labels over the whole sequence."
            )
        args, kwargs = self.engine.shard_sequences((args, kwargs))
        length = self.engine.batch_sequence_length
        if self._step is not None and length != self._step_length:
            self.close_step()  # a new step before the last one's backward (an evaluation call with gradients on)
        if self._step is None:
            self._step, self._step_length = ExitStack(), length
            self._step.enter_context(self.engine.attention_context())
            self._step.enter_context(packed_sequences_not_detected())
            self._step.enter_context(self.engine.global_positions())
        positions = self.engine.positions_argument
        if positions is not None and positions[0] == "":  # the root takes them: its hooks of this call already ran
            filled = self.engine.positions_hook(module)(module, args, kwargs)
            if filled is not None:
                args, kwargs = filled
        return args, kwargs

    def _gather(self, module: Module, args: tuple, kwargs: dict, output: Any) -> Any:
        engine = self.engine
        seq_len = engine.batch_sequence_length
        assert seq_len is not None
        cp, layout = engine.parallel_dims.cp, engine.load_balance
        whole = gather_outputs(output, seq_len, cp, engine.process_group("cp"), layout, for_loss=True)
        if not torch.is_grad_enabled():
            self.close_step()
        return whole

    def close_step(self) -> None:
        """End the step's contexts (after backward, or at the end of a call without gradients)."""
        if self._step is not None:
            step, self._step = self._step, None
            step.close()

    def remove(self) -> None:
        self.close_step()
        for handle in self._handles:
            handle.remove()
