"""``ExportAtFitEnd``: the run's output is a folder serving tools load, written when ``fit`` ends, with no second
command (torchtitan's ``last_save_in_hf``). Every rank first writes its own slices of the model weights, in
parallel, into a temporary sharded checkpoint beside the folder (DCP); rank 0 then converts it as
``lightning-dist export`` does (LoRA merged or the adapter alone, ``dtype``, per-expert layout, tokenizer files
copied) and deletes the temporary checkpoint. The folder equals the offline export of a checkpoint saved at the same
step, tensor by tensor."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dist.checkpoint.export import export_checkpoint
from lightning_dist.checkpoint.export.dtype import export_dtype
from lightning_dist.checkpoint.export.shards import parse_size
from lightning_dist.checkpoint.export.tokenizer import tokenizer_source
from lightning_dist.checkpoint.export_target import check_export_target
from lightning_dist.checkpoint.layout import discard, new_token


class ExportAtFitEnd(Callback):
    """When ``fit`` ends, write the trained model at ``dirpath`` as ``lightning-dist export`` would.

    Args:
        dirpath: The folder to write: a new path, or an earlier export of the same format (checked when the fit
            starts, so a wrong path fails before training).
        format: ``"hf"`` (a Hugging Face model folder; a LoRA model's adapters merged), ``"peft"`` (a LoRA model's
            adapter folder) or ``"litgpt"``.
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` for every floating-point tensor (default: as trained).
        max_shard_size: The largest safetensors file (``hf``), in bytes or as ``"5GB"``.
        tokenizer: The folder to copy the tokenizer files from (default: ``initial_weights``).
        stacked_experts: Keep a mixture-of-experts model's experts stacked (``hf``; default: per expert).

    Use it from Python (``callbacks=[ExportAtFitEnd("out/hf")]``) or YAML::

        trainer:
          callbacks:
            - class_path: lightning_dist.ExportAtFitEnd
              init_args: {dirpath: out/hf, dtype: bfloat16}

    Needs one of lightning_dist's strategies (their checkpoints record the model's config and adapters)."""

    def __init__(
        self,
        dirpath: str,
        format: Literal["hf", "peft", "litgpt"] = "hf",
        dtype: Literal["bfloat16", "float16", "float32"] | None = None,
        max_shard_size: str = "5GB",
        tokenizer: str | None = None,
        stacked_experts: bool = False,
    ) -> None:
        export_dtype(dtype)
        parse_size(max_shard_size)
        self.dirpath, self.format, self.dtype = Path(dirpath), format, dtype
        self.max_shard_size, self.tokenizer, self.stacked_experts = max_shard_size, tokenizer, stacked_experts
        self.report: Any = None
        self.seconds = 0.0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_dist.strategies.base import MeshParallelStrategy

        if stage == "fit" and not isinstance(trainer.strategy, MeshParallelStrategy):
            raise TypeError(
                f"ExportAtFitEnd needs one of lightning_dist's strategies (fsdp2, zeropp, tensor_parallel, ...), not"
                f" {type(trainer.strategy).__name__}: their checkpoints record the model's config and adapters."
            )
        if stage == "fit":  # a wrong path fails before training, not after
            check_export_target(self.dirpath, command="export", fmt=self.format)
            if self.tokenizer is not None:
                tokenizer_source(None, self.tokenizer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start = time.perf_counter()
        token = trainer.strategy.broadcast(new_token())
        source = self.dirpath.parent / f".{self.dirpath.name}.weights-{token}"
        try:
            trainer.save_checkpoint(source, weights_only=True)  # every rank its own slices, in parallel
            if trainer.is_global_zero:
                self.report = export_checkpoint(
                    source, self.dirpath, format=self.format, max_shard_size=self.max_shard_size, dtype=self.dtype,
                    tokenizer=self.tokenizer, stacked_experts=self.stacked_experts,
                )  # fmt: skip
        finally:
            trainer.strategy.barrier("export at fit end")
            if trainer.is_global_zero:
                discard(source)  # the temporary checkpoint this callback wrote
        self.seconds = time.perf_counter() - start
        if self.report is not None:
            merged = f", {self.report.merged} LoRA layers merged" if self.report.merged else ""
            rank_zero_info(
                f"ExportAtFitEnd: wrote {self.dirpath} ({self.format}: {self.report.tensors} tensors,"
                f" {self.report.total_bytes / 2**20:.1f} MiB{merged}) in {self.seconds:.1f} s; {self.report.tokenizer}"
            )
