"""Context parallelism's part in a step: the batch's sequences sharded, attention dispatched to the cp group from
forward to the end of backward, the shard's global positions given to the model, the first output checked for a
sequence dimension, predictions gathered back to whole sequences, and a warning for a synced sum (:mod:`.logged_sums`). The work is done by
:class:`~.sequence_shards.ContextParallelSteps`, which declares this part."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from lightning_dist.compat.hugging_face import packed_sequences_not_detected
from lightning_dist.parallel.context_parallel.batch import gather_outputs
from lightning_dist.strategies.parallelisms.context_parallel.logged_sums import summed_logs_warned
from lightning_dist.strategies.lifecycle.step_part import StepPart, StepRun

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dist.strategies.parallelisms.context_parallel.sequence_shards import ContextParallelSteps


class ContextParallelPart(StepPart):
    """The part of a strategy with :class:`ContextParallelSteps` on a mesh with ``cp > 1``."""

    strategy: ContextParallelSteps
    axis = "cp"

    def preflight_before_model(self, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        self.strategy.check_first_batch_before_launch(trainer, arguments)

    def transform_batch(self, batch: Any, dataloader_idx: int) -> Any:
        return self.strategy.shard_sequences(batch)

    def train_contexts(self) -> list[AbstractContextManager]:
        return [self.strategy.attention_context(), packed_sequences_not_detected()]

    def wrap_training_step(self, run: StepRun) -> StepRun:
        strategy = self.strategy

        def training_step(*args: Any, **kwargs: Any) -> Any:
            with (
                strategy.global_positions(),
                strategy.first_output_checked("training_step"),
                summed_logs_warned(strategy.lightning_module, strategy.parallel_dims.cp, strategy.warned_sums),
            ):
                return run(*args, **kwargs)

        return training_step

    def wrap_eval_step(self, step: str, run: StepRun) -> StepRun:
        strategy = self.strategy

        def eval_step(*args: Any, **kwargs: Any) -> Any:
            with (
                strategy.attention_context(),
                packed_sequences_not_detected(),
                strategy.global_positions(),
                strategy.first_output_checked(step),
                summed_logs_warned(strategy.lightning_module, strategy.parallel_dims.cp, strategy.warned_sums),
            ):
                output = run(*args, **kwargs)
            seq_len = strategy.batch_sequence_length
            if step == "predict_step" and seq_len is not None and output is not None:
                cp, group = strategy.parallel_dims.cp, strategy.process_group("cp")
                output = gather_outputs(output, seq_len, cp, group, strategy.load_balance)
            return output

        return eval_step
