"""``MeshThroughputMonitor``: tokens/s, TFLOP/s per device and MFU, logged every ``log_every_n_steps``, counted
over the mesh (see :mod:`lightning_dist.profiling.throughput`)."""

from __future__ import annotations

import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dist.profiling.flops import TokenFlops, token_flops
from lightning_dist.profiling.peaks import device_peak_tflops, matmul_dtype
from lightning_dist.profiling.throughput import first_tensor, throughput_figures, token_ids


class MeshThroughputMonitor(Callback):
    """Logs, every ``log_every_n_steps`` optimizer steps, the throughput of the steps since the previous value:

    * ``throughput/tokens_per_s``: tokens of the whole job per second;
    * ``throughput/tokens_per_s_per_device``: that, divided by every device of the job;
    * ``throughput/tflops_per_device``: model TFLOP/s per device, ``(6·N + 12·L·H·S)`` per token (PaLM, appendix
      B; ``N`` the active non-embedding parameters, see :mod:`lightning_dist.profiling.flops`);
    * ``throughput/mfu``: that, as a fraction of the device's dense peak (:mod:`lightning_dist.profiling.peaks`).

    The count follows the mesh: the tokens a rank holds are multiplied by the data-parallel replicas and the
    context-parallel shards only (tensor- and pipeline-parallel ranks share their samples), and the FLOPs are
    divided by every device. Under any other Lightning strategy the replicas are its sampler's ``num_replicas``.
    Time spent in validation is left out. Tokens are read from the batch: ``batch["input_ids"]`` or the first
    integer tensor ``[batch, seq]`` (padding included).

    Use it from Python (``callbacks=[MeshThroughputMonitor()]``) or YAML::

        trainer:
          callbacks:
            - class_path: lightning_dist.MeshThroughputMonitor
              init_args: {peak_tflops: null}

    Args:
        peak_tflops: The device's peak TFLOP/s to compute MFU against. Default: looked up by the GPU's name and
            the precision's matmul dtype; on a CPU (or a GPU the table lacks) no MFU is logged unless it is given.
        peak_dtype: Which peak of the table MFU is against (``"fp8"``, ``"bf16"``, ...). Default: the matmul dtype
            of ``precision`` (``bf16`` for ``bf16-mixed``, also when float8 matmuls are on, as torchtitan reports
            it, so that runs with and without FP8 compare).
        flops_per_token: Training FLOPs per token, when the model's own count is not wanted (or not possible: a
            model without repeated blocks). Default: counted from the model before it is parallelized.
        experts_per_token: ``k`` of a mixture-of-experts model whose modules and config do not hold it.
        tokens_per_sample: Tokens per sample when the batch holds no token ids (the samples are the first
            dimension of the batch's first tensor).
        prog_bar: Also show the figures in the progress bar.
    """

    def __init__(
        self,
        peak_tflops: float | None = None,
        peak_dtype: Literal["fp8", "bf16", "fp16", "tf32", "fp32"] | None = None,
        flops_per_token: float | None = None,
        experts_per_token: int | None = None,
        tokens_per_sample: int | None = None,
        prog_bar: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("peak_tflops", peak_tflops), ("flops_per_token", flops_per_token)):
            if value is not None and not value > 0:
                raise ValueError(f"MeshThroughputMonitor({name}={value!r}): give a positive number, or None.")
        self.peak_tflops = peak_tflops
        self.peak_dtype = peak_dtype
        self.flops_per_token = flops_per_token
        self.experts_per_token = experts_per_token
        self.tokens_per_sample = tokens_per_sample
        self.prog_bar = prog_bar
        #: The figures of the last logged interval (``{}`` before the first).
        self.last_figures: dict[str, float] = {}
        self._flops: TokenFlops | None = None
        self._flops_error = ""
        self._peak: float | None = None
        self._replicas = self._seq_shards = 1
        self._warned: set[str] = set()
        self._reset(0.0, 0)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == TrainerFn.FITTING and self.flops_per_token is None:
            self._count_flops(pl_module)  # before the strategy shards it: every parameter is still here

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dims = getattr(trainer.strategy, "parallel_dims", None)
        if dims is not None:  # a lightning_dist strategy
            self._replicas, self._seq_shards = dims.batch, dims.cp
        else:
            sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
            self._replicas, self._seq_shards = int(sampler.get("num_replicas", 1)), 1
        if self.flops_per_token is None and self._flops is None and (dims is None or dims.pp == 1):
            self._count_flops(pl_module)  # built in configure_model: counted now, DTensors hold global sizes
        if self.flops_per_token is None and self._flops is None:
            self._warn_once("flops", f"MeshThroughputMonitor logs no TFLOP/s or MFU: {self._flops_error}")
        self._peak = self._resolve_peak(trainer)
        rank_zero_info(self._describe(trainer))
        self._reset(self._now(trainer), trainer.global_step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        counted = self._count_tokens(batch)
        if counted is None:
            return
        tokens, seq_len = counted
        self._tokens += tokens
        if self.flops_per_token is not None:
            self._flops_sum += tokens * self.flops_per_token
        elif self._flops is not None:
            self._flops_sum += tokens * self._flops.per_token(seq_len)
        if trainer.global_step == self._step:  # accumulating gradients: no optimizer step yet
            return
        self._step = trainer.global_step
        every = trainer.log_every_n_steps
        if not every or trainer.global_step % every:
            return
        now = self._now(trainer)
        seconds = now - self._start - self._paused
        known_flops = self.flops_per_token is not None or self._flops is not None
        figures = throughput_figures(
            self._tokens,
            seconds,
            trainer.world_size,
            self._flops_sum / self._tokens if known_flops else None,
            self._peak,
        )
        self.last_figures = figures
        metrics = {f"throughput/{name}": value for name, value in figures.items()}
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=self.prog_bar, batch_size=1)
        self._reset(now, trainer.global_step)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._validation_start = self._now(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._paused += self._now(trainer) - self._validation_start

    # ------------------------------------------------------------------ helpers
    def _reset(self, now: float, step: int) -> None:
        self._start, self._step = now, step
        self._paused = self._validation_start = 0.0
        self._tokens = self._flops_sum = 0.0

    def _now(self, trainer: pl.Trainer) -> float:
        device = trainer.strategy.root_device
        if device.type == "cuda":  # the kernels queued so far belong to the interval
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _count_flops(self, model: torch.nn.Module) -> None:
        try:
            self._flops = token_flops(model, self.experts_per_token)
        except Exception as error:  # noqa: BLE001 (a model the count cannot read must not stop training)
            self._flops_error = f"{error} Pass flops_per_token=... to log them."

    def _count_tokens(self, batch: Any) -> tuple[float, int] | None:
        """The job's tokens in this step's batch and the full (unsharded) sequence length."""
        ids = token_ids(batch)
        if ids is not None:
            samples, seq_len = ids.shape[0], ids.shape[1] * self._seq_shards
        elif self.tokens_per_sample is not None:
            first = first_tensor(batch)
            samples, seq_len = (first.shape[0] if first is not None and first.dim() else 1), self.tokens_per_sample
        else:
            self._warn_once(
                "tokens",
                "MeshThroughputMonitor found no token ids in the batch (batch['input_ids'], or an integer tensor of"
                " shape [batch, seq]); pass tokens_per_sample=... to count a batch of other data.",
            )
            return None
        return float(samples * seq_len * self._replicas), seq_len

    def _resolve_peak(self, trainer: pl.Trainer) -> float | None:
        if self.peak_tflops is not None:
            return self.peak_tflops
        device = trainer.strategy.root_device
        dtype = self.peak_dtype or matmul_dtype(str(trainer.precision))
        peak = device_peak_tflops(device, dtype)
        if peak is None and device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            self._warn_once("peak", f"No {dtype} peak is known for {name!r}: pass peak_tflops=... to log MFU.")
        return peak

    def _describe(self, trainer: pl.Trainer) -> str:
        flops = "flops_per_token as given" if self.flops_per_token is not None else "no FLOPs"
        if self._flops is not None:
            f = self._flops
            flops = (
                f"6·N + 12·L·H·S FLOPs per token with N = {f.active_params:,.0f} active non-embedding"
                f" parameters, L = {f.layers}, H = {f.attention_width}"
            )
        peak = f"peak {self._peak:g} TFLOP/s per device" if self._peak else "no peak (no MFU)"
        return (
            f"MeshThroughputMonitor: tokens per step = one rank's × {self._replicas} data-parallel replicas ×"
            f" {self._seq_shards} context-parallel shards, FLOPs over {trainer.world_size} devices; {flops}; {peak}"
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)
