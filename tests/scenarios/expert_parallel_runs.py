"""Expert parallelism under the Trainer: a stock tiny ``MixtralForCausalLM`` trained by fsdp2 with
``expert_parallel_size`` against one process, and the bytes of one step against plain fsdp2.

python tests/scenarios/expert_parallel_runs.py --devices 1 --out ref.json --workdir DIR --scenarios fp64,fp32
python tests/scenarios/expert_parallel_runs.py --devices 2 --out r.json --workdir DIR --scenarios ep_fp64,ep_fp32,bytes

``pipeline_fp32`` trains the same model (with transformers' default grouped-mm experts kernel) under pp=2;
``resume_ep_to_fsdp2`` (after ``ep_fp64``, which checkpoints at step 2) resumes that checkpoint under plain fsdp2.

With 4 processes (dp_shard=4, ep=2: two ep groups whose ranks hold the same experts pairwise):
``ep2_of_4_unseeded`` builds the model with a different seed on every rank and reports how far the expert shards of
ranks holding the same experts are apart after setup and after training; ``ep2_of_4_fp64`` is the seeded run against
one process, checkpointing at step 2 (experts split over ep and FSDP-sharded over the other 2 ranks), and
``resume_ep2_to_ep4`` / ``resume_ep2_of_4_to_fsdp2`` resume that checkpoint with ep=4 / plain fsdp2;
``pp2_dp2_ep2`` and ``tp2_ep2`` train under hybrid3d with ep=2. The ``litgpt`` scenarios train litgpt's
``LLaMAMoE`` (``ModuleList`` experts), the ``qwen*`` ones Qwen3-MoE and Qwen2-MoE.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import (  # type: ignore[import-not-found]
    GLOBAL_BATCH,
    SEQ_LEN,
    AllStagesRecorder,
    LogLines,
    OneProcessData,
    StepRecorder,
    all_ranks_state,
    mean_over_ranks,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from examples.data import TextDataModule
from examples.moe import LitGPTMoE, MoECausalLM
from lightning_dist import FSDP2Strategy, Hybrid3DStrategy, PipelineStrategy, ZeroPPStrategy
from lightning_dist.profiling import CommCounter, attach_phase_hooks

STEPS = 4
ACCUMULATE = 2
CLIP = 0.5


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
    """The largest difference between the expert weights as ranks see them whole (each rank's view of every expert
    weight, gathered from the ranks it is split over), after setup and after training: 0.0 when all ranks agree,
    as the copies held by ranks with the same experts (``ep_replicas``; dp_replicate only, once FSDP2 shards the
    experts over ``ep_fsdp``) must be bitwise equal for that."""

    def __init__(self) -> None:
        self.gaps: dict[str, float] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.gaps["after_setup"] = self._gap(pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.gaps["after_training"] = self._gap(pl_module)

    @staticmethod
    def _gap(pl_module: L.LightningModule) -> float:
        whole = torch.cat(
            [p.full_tensor().detach().reshape(-1) for n, p in pl_module.named_parameters() if "experts" in n]
        )
        copies = [torch.empty_like(whole) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, whole)
        return float(torch.stack([(c - whole).abs().max() for c in copies]).max())


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
    check_export: bool = False,
    hybrid3d: dict[str, Any] | None = None,
    log_load: bool = False,
    zeropp: bool = False,
    batch_divisor: int = 1,
    dispatch_chunks: int = 1,
) -> dict[str, Any]:
    """Train the model of ``kind``; ``hybrid3d``: under ``Hybrid3DStrategy(expert_parallel_size=ep, **hybrid3d)``
    instead of fsdp2, also reporting its mesh, log lines and expert shards' shapes; ``batch_divisor``: batches that
    many times smaller, that many times more of them accumulated per step."""
    L.seed_everything(1234, verbose=False)
    dp = 1 if pipeline else (hybrid3d or {}).get("data_parallel_shard_size", devices)
    data_cls = OneProcessData if dp == 1 else TextDataModule
    data = data_cls(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp // batch_divisor, train_samples=256, val_samples=32)
    if seed_by_rank:  # no common seed: every rank initializes its own weights
        torch.manual_seed(100 + int(os.environ.get("LOCAL_RANK", "0")))
    # Under the pipeline: transformers' default experts kernel (grouped_mm), whose meta kernel takes bf16 only.
    if kind == "litgpt":
        model: L.LightningModule = LitGPTMoE(64, seq_len=SEQ_LEN)  # the data's 63 tokens, a vocabulary tp divides
    else:
        kernel = "grouped_mm" if pipeline else "eager"
        model = MoECausalLM(data.vocab_size, kind, aux, seq_len=SEQ_LEN, experts_implementation=kernel)
    strategy: Any = "auto"
    if devices > 1:
        strategy = FSDP2Strategy(
            expert_parallel_size=ep or 1, log_expert_load=log_load, expert_dispatch_chunks=dispatch_chunks
        )
    if pipeline:
        strategy = PipelineStrategy()
    if zeropp:  # ZeRO++'s int8 weight all-gather and int4 gradient reduce-scatter on the dense parts
        strategy = ZeroPPStrategy(expert_parallel_size=ep or 1)
    if hybrid3d is not None:
        strategy = Hybrid3DStrategy(expert_parallel_size=ep or 1, log_expert_load=log_load, **hybrid3d)
        lines = LogLines("hybrid3d")
    recorder, counter, replicas = (
        (AllStagesRecorder() if pipeline or hybrid3d is not None else StepRecorder()),
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
        accumulate_grad_batches=1 if traffic else ACCUMULATE * batch_divisor,
        gradient_clip_val=None if traffic else CLIP,
        callbacks=callbacks,
    )
    trainer.fit(model, data, ckpt_path=resume_from)
    result: dict[str, Any] = {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "aux": model.aux_losses}
    if log_load:  # the last step's logged expert load
        load = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("expert_load/")}
        result["expert_load"] = load
    if seed_by_rank:
        return {**result, "replica_gap": replicas.gaps}
    if traffic:
        result["bytes"] = counter.table()
        result["local_tokens"] = GLOBAL_BATCH // devices * SEQ_LEN
        result["expert_local_shapes"] = sorted(
            {str(tuple(p.to_local().shape)) for n, p in model.named_parameters() if "experts" in n}
        )
    elif not pipeline:
        result["params"], result["copies_gap"] = all_ranks_state(model)
        result["expert_fraction"] = _held_fraction(model)
        result["expert_local_numel"] = sum(
            getattr(p, "to_local", lambda p=p: p)().numel() for n, p in model.named_parameters() if "experts" in n
        )
    if check_export:
        result["export"] = consolidated_logits_diff(model, f"{save_to}/step={steps}.ckpt")
    if hybrid3d is not None:
        lines.close()
        experts = [p for n, p in model.named_parameters() if "experts" in n]
        result.update(
            mesh=str(strategy.parallel_dims),
            log=lines.lines,
            expert_local_shapes=sorted({str(tuple(getattr(p, "to_local", lambda p=p: p)().shape)) for p in experts}),
        )
    return result


def _held_fraction(model: L.LightningModule) -> float:
    """The share of the stacked expert weights' elements this rank holds (rank 0's; 1.0: all of them)."""
    experts = [p for n, p in model.named_parameters() if "experts" in n and hasattr(p, "to_local")]
    return sum(p.to_local().numel() for p in experts) / max(1, sum(p.numel() for p in experts))


def consolidated_logits_diff(model: MoECausalLM, checkpoint: str) -> dict[str, Any]:
    """``lightning-dist consolidate`` of the run's last checkpoint (experts saved split over ep), loaded into a stock
    ``MixtralForCausalLM`` with ``strict=True``: the largest difference of its logits from the run's model's."""
    from transformers import MixtralForCausalLM

    tokens = torch.randint(0, model.model.config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # every rank: the ep forward is collective
        run_logits = model.model(input_ids=tokens).logits
    result: dict[str, Any] = {}
    if dist.get_rank() == 0:  # the command as a user runs it: its own process, no process group
        out = f"{os.path.dirname(checkpoint)}/consolidated.pt"
        subprocess.run([shutil.which("lightning-dist") or "lightning-dist", "consolidate", checkpoint, out,
                        "--weights-only"], check=True, timeout=600)  # fmt: skip
        state = torch.load(out, weights_only=True)["state_dict"]
        stock = MixtralForCausalLM(model.model.config).to(run_logits.dtype)
        stock.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
        with torch.no_grad():
            stock_logits = stock(input_ids=tokens).logits
        result = {"logits_diff": float((stock_logits - run_logits).abs().max()), "tensors": len(state)}
    dist.barrier()
    return result


def resume(devices: int, workdir: str) -> dict[str, Any]:
    """Plain fsdp2 (``expert_parallel_size=1``: experts FSDP-sharded, no ep) resumes from the step-2 checkpoint
    ``ep_fp64`` saved under ep=2."""
    return train(devices, "64-true", 1, resume_from=f"{workdir}/ep_ckpt/step=2.ckpt")


def resume_fsdp2_to_ep(devices: int, workdir: str) -> dict[str, Any]:
    """Plain fsdp2 trains 2 steps and checkpoints; ep=2 resumes that checkpoint for steps 3-4."""
    first = train(devices, "64-true", 1, steps=2, save_to=f"{workdir}/fsdp2_ckpt")
    second = train(devices, "64-true", devices, resume_from=f"{workdir}/fsdp2_ckpt/step=2.ckpt")
    return {"first_losses": first["losses"], "losses": second["losses"]}


SCENARIOS = {
    "fp64": lambda devices, workdir: train(devices, "64-true", None),
    "fp32": lambda devices, workdir: train(devices, "32-true", None),
    "ep_fp64": lambda devices, workdir: train(
        devices, "64-true", devices, save_to=f"{workdir}/ep_ckpt", check_export=True
    ),
    "ep_fp32": lambda devices, workdir: train(devices, "32-true", devices, log_load=True),
    "zeropp_ep_fp32": lambda devices, workdir: train(devices, "32-true", devices, zeropp=True),
    "bytes_fsdp2": lambda devices, workdir: train(devices, "32-true", None, steps=2, traffic=True),
    "bytes_ep": lambda devices, workdir: train(devices, "32-true", devices, steps=2, traffic=True),
    "pipeline_fp32": lambda devices, workdir: train(devices, "32-true", None, pipeline=True),
    "resume_ep_to_fsdp2": resume,
    "resume_fsdp2_to_ep": resume_fsdp2_to_ep,
    "ep2_of_4_unseeded": lambda devices, workdir: train(devices, "64-true", 2, steps=2, seed_by_rank=True),
    "ep2_of_4_fp64": lambda devices, workdir: train(devices, "64-true", 2, save_to=f"{workdir}/ep2_of_4_ckpt"),
    "resume_ep2_to_ep4": lambda devices, workdir: train(
        devices, "64-true", 4, resume_from=f"{workdir}/ep2_of_4_ckpt/step=2.ckpt"
    ),
    "resume_ep2_of_4_to_fsdp2": lambda devices, workdir: train(
        devices, "64-true", 1, resume_from=f"{workdir}/ep2_of_4_ckpt/step=2.ckpt"
    ),
}


def litgpt_empty_init(devices: int, workdir: str) -> dict[str, Any]:
    """litgpt's MoE built under ``trainer.init_module(empty_init=True)`` (meta device, materialized after the
    experts are split by ``reset_parameters``), one step under ep: each rank must keep its own experts (materializing
    makes new parameter objects; replicated-state broadcasting must still leave the held experts alone)."""
    L.seed_everything(1234, verbose=False)
    data = TextDataModule(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // devices, train_samples=64, val_samples=8)
    strategy = FSDP2Strategy(expert_parallel_size=devices)
    at_start = _StateAtTrainStart()
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy, precision="32-true", limit_val_batches=0),
                        max_steps=1, gradient_clip_val=CLIP, callbacks=[at_start])  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = LitGPTMoE(data.vocab_size, seq_len=SEQ_LEN)
    trainer.fit(model, data)
    params, _ = all_ranks_state(model)
    weight = "model.transformer.h.0.mlp.experts.{}.fc_1.weight"
    first, third = (torch.tensor(at_start.params[weight.format(e)]) for e in (0, 2))  # held by ranks 0 and 1
    return {"expert_0_vs_2": float((first - third).abs().max()), "finite": all(map(_finite, params.values()))}


class _StateAtTrainStart(Callback):
    """Every parameter whole, from the ranks holding it, once the model is set up (before any step)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params, _ = all_ranks_state(pl_module)


def _finite(value: Any) -> bool:
    return bool(torch.isfinite(torch.tensor(value)).all())


# litgpt's LLaMAMoE (ModuleList experts): ep=2 checkpoints at step 2, plain fsdp2 resumes it.
SCENARIOS["litgpt_empty_init"] = litgpt_empty_init
SCENARIOS["litgpt_fp64"] = lambda devices, workdir: train(devices, "64-true", None, kind="litgpt")
SCENARIOS["ep_litgpt_fp64"] = lambda devices, workdir: train(
    devices, "64-true", devices, kind="litgpt", save_to=f"{workdir}/litgpt_ckpt"
)
SCENARIOS["resume_litgpt_ep_to_fsdp2"] = lambda devices, workdir: train(
    devices, "64-true", 1, kind="litgpt", resume_from=f"{workdir}/litgpt_ckpt/step=2.ckpt"
)
# 4 processes, ep=2: each rank's 2 experts FSDP-sharded over the 2 ranks ep leaves; resumed under ep=4 and fsdp2
SCENARIOS["litgpt_ep2_of_4_fp64"] = lambda devices, workdir: train(
    devices, "64-true", 2, kind="litgpt", save_to=f"{workdir}/litgpt_ep2_of_4_ckpt"
)
for _name, _ep in (("ep4", 4), ("fsdp2", 1)):
    SCENARIOS[f"resume_litgpt_ep2_of_4_to_{_name}"] = partial(
        lambda d, w, ep: train(d, "64-true", ep, kind="litgpt", resume_from=f"{w}/litgpt_ep2_of_4_ckpt/step=2.ckpt"),
        ep=_ep,
    )
# Qwen3-MoE and Qwen2-MoE (shared expert), without and with the router's auxiliary loss: 2 steps × 2 micro-batches.
for _kind in ("qwen3_moe", "qwen2_moe"):
    for _aux in ("", "_aux"):
        _options = {"steps": 2, "kind": _kind, "aux": bool(_aux)}
        SCENARIOS[f"{_kind}{_aux}_fp64"] = partial(lambda d, w, o: train(d, "64-true", None, **o), o=_options)
        # the runs with the auxiliary loss send each layer's tokens in 2 overlapping chunks (expert_dispatch_chunks)
        _ep_options = {**_options, "dispatch_chunks": 2 if _aux else 1}
        SCENARIOS[f"ep_{_kind}{_aux}_fp64"] = partial(lambda d, w, o: train(d, "64-true", d, **o), o=_ep_options)
# hybrid3d with ep=2 on 4 processes: 2 pipeline stages, each splitting its MoE layer's experts over its 2
# data-parallel ranks; and attention tensor-parallel over tp=2 with the experts split over the 2 data-parallel ranks
# and replicated over tp. (The automatic plan would also shard the embedding and head over the vocabulary, which the
# data's 63 tokens do not divide; it leaves the MoE blocks whole, as this plan does.)
_ATTENTION_PLAN = {f"model.model.layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")}
_ATTENTION_PLAN["model.model.layers.*.self_attn.o_proj"] = "rowwise"
SCENARIOS["pp2_dp2_ep2"] = lambda devices, workdir: train(
    devices, "64-true", 2, hybrid3d={"pipeline_parallel_size": 2, "data_parallel_shard_size": 2}, log_load=True
)
SCENARIOS["litgpt_pp2_dp2_ep2"] = lambda devices, workdir: train(
    devices, "64-true", 2, kind="litgpt", hybrid3d={"pipeline_parallel_size": 2, "data_parallel_shard_size": 2}
)
SCENARIOS["litgpt_tp2_ep2"] = lambda devices, workdir: train(  # the automatic plan, the MoE layers left whole
    devices, "64-true", 2, kind="litgpt", hybrid3d={"tensor_parallel_size": 2, "data_parallel_shard_size": 2}
)
# The router's auxiliary loss across pipeline stages (each stage's routing statistics sent on with the activation).
# One micro-batch per step: one process's loss exactly. Two: the loss of each micro-batch, as one process computes it
# accumulating batches half as large.
_QWEN3_AUX = {"steps": 2, "kind": "qwen3_moe", "aux": True}
SCENARIOS["pp2_dp2_ep2_qwen3_moe_aux_fp64"] = lambda devices, workdir: train(
    devices, "64-true", 2, **_QWEN3_AUX,
    hybrid3d={"pipeline_parallel_size": 2, "data_parallel_shard_size": 2, "schedule": "gpipe", "n_microbatches": 1},
)  # fmt: skip
SCENARIOS["pp2_microbatches2_qwen3_moe_aux_fp64"] = lambda devices, workdir: train(
    devices, "64-true", None, **_QWEN3_AUX,
    hybrid3d={"pipeline_parallel_size": 2, "data_parallel_shard_size": 1, "schedule": "gpipe", "n_microbatches": 2},
)  # fmt: skip
SCENARIOS["half_batches_qwen3_moe_aux_fp64"] = lambda devices, workdir: train(
    devices, "64-true", None, **_QWEN3_AUX, batch_divisor=2
)
SCENARIOS["tp2_ep2"] = lambda devices, workdir: train(
    devices, "64-true", 2, hybrid3d={"tensor_parallel_size": 2, "data_parallel_shard_size": 2, "plan": _ATTENTION_PLAN}
)

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
