"""Expert parallelism under the Trainer: a stock tiny ``MixtralForCausalLM`` trained by fsdp2 with
``expert_parallel_size`` against one process, and the bytes of one step against plain fsdp2.

python tests/scenarios/expert_parallel_runs.py --devices 1 --out ref.json --workdir DIR --scenarios fp64,fp32
python tests/scenarios/expert_parallel_runs.py --devices 2 --out r.json --workdir DIR --scenarios ep_fp64,ep_fp32,bytes

``pipeline_fp32`` trains the same model (with transformers' default grouped-mm experts kernel) under pp=2;
``resume_ep_to_fsdp2`` (after ``ep_fp64``, which checkpoints at step 2) resumes that checkpoint under plain fsdp2.

With 4 processes (dp_shard=4, ep=2: two ep groups whose ranks hold the same experts pairwise):
``ep2_of_4_unseeded`` builds the model with a different seed on every rank and reports how far the expert shards of
ranks holding the same experts are apart after setup and after training; ``ep2_of_4_fp64`` is the seeded run against
one process, checkpointing at step 2, and ``resume_ep2_to_ep4`` resumes that checkpoint with ep=4.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (  # type: ignore[import-not-found]
    GLOBAL_BATCH,
    SEQ_LEN,
    AllStagesRecorder,
    OneProcessData,
    StepRecorder,
    full_state,
    mean_over_ranks,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from examples.data import TextDataModule
from lightning_dist import FSDP2Strategy, PipelineStrategy
from lightning_dist.profiling import CommCounter, attach_phase_hooks

STEPS = 4
ACCUMULATE = 2
CLIP = 0.5
HIDDEN, EXPERTS, TOP_K = 32, 4, 2
AUX_COEF = 0.5
_SPARSE = {"moe_intermediate_size": 24, "intermediate_size": 48, "num_experts": EXPERTS, "mlp_only_layers": []}
MOE_MODELS = {  # transformers class prefix, the MoE part of the config
    "mixtral": ("Mixtral", {"intermediate_size": 48, "num_local_experts": EXPERTS, "router_jitter_noise": 0.0}),
    "qwen3_moe": ("Qwen3Moe", _SPARSE),
    "qwen2_moe": ("Qwen2Moe", {**_SPARSE, "shared_expert_intermediate_size": 40}),
}


class MixtralLM(L.LightningModule):
    """A stock tiny ``MixtralForCausalLM`` (2 MoE layers of 4 experts, top-2), next-token loss on its logits.

    ``kind`` builds a stock tiny Qwen3-MoE or Qwen2-MoE (with its shared expert) of the same size instead; ``aux``
    turns on the router's auxiliary loss (``output_router_logits=True``), added with ``router_aux_loss_coef``.
    """

    def __init__(
        self, vocab_size: int, experts_implementation: str = "eager", kind: str = "mixtral", aux: bool = False
    ) -> None:
        super().__init__()
        import transformers

        prefix, extra = MOE_MODELS[kind]
        if aux:
            extra = {**extra, "output_router_logits": True, "router_aux_loss_coef": AUX_COEF}
        config = getattr(transformers, f"{prefix}Config")(
            vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=TOP_K, max_position_embeddings=SEQ_LEN,
            attn_implementation="eager", experts_implementation=experts_implementation, **extra,
        )  # fmt: skip
        self.model = getattr(transformers, f"{prefix}ForCausalLM")(config)
        self.aux_losses: list[float] = []  # transformers computes it in fp32: the tests compare it apart

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # The loss from the logits in their own dtype: transformers' loss casts them to fp32, hiding fp64 parity.
        x = batch["input_ids"]
        out = self.model(input_ids=x)
        logits = out.logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        if out.aux_loss is not None:
            self.aux_losses.append(float(out.aux_loss))
            loss = loss + self.model.config.router_aux_loss_coef * out.aux_loss.to(loss.dtype)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class StepTraffic(Callback):
    """Bytes each rank sends in training step 1 (the second), by collective and phase."""

    def __init__(self) -> None:
        self.counter = CommCounter()
        self.hooks: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx == 1:
            self.hooks = attach_phase_hooks(trainer.strategy.model, self.counter, optimizers=[])
            self.counter.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.counter.active:
            self.counter.__exit__(None, None, None)
            self.hooks.remove()

    def table(self) -> dict[str, float]:
        c = self.counter
        a2a = "all_to_all_single"
        return mean_over_ranks(
            {
                "all_gather": c.total(op="all_gather_into_tensor"),
                "all_to_all_forward": c.total(op=a2a, phase="forward"),
                "all_to_all_backward": c.total(op=a2a, phase="backward"),
                "all_to_all_count": c.total("count", op=a2a),
                "reduce_scatter": c.total(op="reduce_scatter_tensor"),
                "total": c.total(),
            }
        )


class ExpertReplicaGap(Callback):
    """The largest difference between the expert shards of ranks that hold the same experts (``ep_replicas``),
    after setup and after training: 0.0 when the copies are bitwise equal."""

    def __init__(self) -> None:
        self.gaps: dict[str, float] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.gaps["after_setup"] = self._gap(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.gaps["after_training"] = self._gap(trainer, pl_module)

    @staticmethod
    def _gap(trainer: L.Trainer, pl_module: L.LightningModule) -> float:
        mine = torch.cat([p.to_local().detach().reshape(-1) for n, p in pl_module.named_parameters() if "experts" in n])
        group = trainer.strategy.mesh["ep_replicas"].get_group()
        copies = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, mine, group=group)
        gap = torch.stack([(c - mine).abs().max() for c in copies]).max().reshape(1)
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
        return float(gap)


def train(
    devices: int,
    precision: str,
    ep: int | None,
    steps: int = STEPS,
    traffic: bool = False,
    pipeline: bool = False,
    save_to: str | None = None,
    resume_from: str | None = None,
    seed_by_rank: bool = False,
    kind: str = "mixtral",
    aux: bool = False,
) -> dict[str, Any]:
    L.seed_everything(1234, verbose=False)
    dp = 1 if pipeline else devices
    data_cls = OneProcessData if dp == 1 else TextDataModule
    data = data_cls(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp, train_samples=256, val_samples=32)
    if seed_by_rank:  # no common seed: every rank initializes its own weights
        torch.manual_seed(100 + int(os.environ.get("LOCAL_RANK", "0")))
    # Under the pipeline: transformers' default experts kernel (grouped_mm), whose meta kernel takes bf16 only.
    model = MixtralLM(data.vocab_size, "grouped_mm" if pipeline else "eager", kind, aux)
    strategy: Any = "auto" if devices == 1 else FSDP2Strategy(expert_parallel_size=ep or 1)
    if pipeline:
        strategy = PipelineStrategy()
    recorder, counter, replicas = (
        (AllStagesRecorder() if pipeline else StepRecorder()),
        StepTraffic(),
        ExpertReplicaGap(),
    )
    callbacks: list[Callback] = [recorder, counter] if traffic else [recorder]
    if seed_by_rank:
        callbacks.append(replicas)
    if save_to:
        callbacks.append(ModelCheckpoint(dirpath=save_to, every_n_train_steps=2, save_top_k=-1, filename="{step}"))
    trainer = L.Trainer(
        **trainer_kwargs(
            devices, strategy=strategy, precision=precision, limit_val_batches=0, enable_checkpointing=bool(save_to)
        ),
        max_steps=steps,
        accumulate_grad_batches=1 if traffic else ACCUMULATE,
        gradient_clip_val=None if traffic else CLIP,
        callbacks=callbacks,
    )
    trainer.fit(model, data, ckpt_path=resume_from)
    result: dict[str, Any] = {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "aux": model.aux_losses}
    if seed_by_rank:
        return {**result, "replica_gap": replicas.gaps}
    if traffic:
        result["bytes"] = counter.table()
        result["local_tokens"] = GLOBAL_BATCH // devices * SEQ_LEN
        result["expert_local_shapes"] = sorted(
            {str(tuple(p.to_local().shape)) for n, p in model.named_parameters() if "experts" in n}
        )
    elif not pipeline:
        result["params"] = {n: t.tolist() for n, t in full_state(model).items()}
    return result


def resume(devices: int, workdir: str) -> dict[str, Any]:
    """Plain fsdp2 (experts FSDP-sharded, no ep) resumes from the step-2 checkpoint ``ep_fp64`` saved under ep=2."""
    return train(devices, "64-true", None, resume_from=f"{workdir}/ep_ckpt/step=2.ckpt")


SCENARIOS = {
    "fp64": lambda devices, workdir: train(devices, "64-true", None),
    "fp32": lambda devices, workdir: train(devices, "32-true", None),
    "ep_fp64": lambda devices, workdir: train(devices, "64-true", devices, save_to=f"{workdir}/ep_ckpt"),
    "ep_fp32": lambda devices, workdir: train(devices, "32-true", devices),
    "bytes_fsdp2": lambda devices, workdir: train(devices, "32-true", None, steps=2, traffic=True),
    "bytes_ep": lambda devices, workdir: train(devices, "32-true", devices, steps=2, traffic=True),
    "pipeline_fp32": lambda devices, workdir: train(devices, "32-true", None, pipeline=True),
    "resume_ep_to_fsdp2": resume,
    "ep2_of_4_unseeded": lambda devices, workdir: train(devices, "64-true", 2, steps=2, seed_by_rank=True),
    "ep2_of_4_fp64": lambda devices, workdir: train(devices, "64-true", 2, save_to=f"{workdir}/ep2_of_4_ckpt"),
    "resume_ep2_to_ep4": lambda devices, workdir: train(
        devices, "64-true", 4, resume_from=f"{workdir}/ep2_of_4_ckpt/step=2.ckpt"
    ),
}

# Qwen3-MoE and Qwen2-MoE (shared expert), without and with the router's auxiliary loss: 2 steps × 2 micro-batches.
for _kind in ("qwen3_moe", "qwen2_moe"):
    for _aux in ("", "_aux"):
        _options = {"steps": 2, "kind": _kind, "aux": bool(_aux)}
        SCENARIOS[f"{_kind}{_aux}_fp64"] = partial(lambda d, w, o: train(d, "64-true", None, **o), o=_options)
        SCENARIOS[f"ep_{_kind}{_aux}_fp64"] = partial(lambda d, w, o: train(d, "64-true", d, **o), o=_options)

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
