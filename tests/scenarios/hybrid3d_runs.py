"""Hybrid3DStrategy in a real Trainer: the unchanged example GPT on meshes that combine two or three of pp, dp, cp
and tp, each against one process on the same global batch (fp64). A scenario name is a mesh, ``pp2_tp2`` or
``pp2_dp2_tp2`` (``hsdp2`` for dp_replicate=2 × dp_shard=2), optionally behind a variant prefix of ``VARIANTS``
(``hf_``, ``gpt2_``, ``tied_``, ``acc_``, ``acclast_``, ``wrap_``, ``zeropp_``); every rank saves its final parameters (whole tensors of its stages) for the test.

python tests/scenarios/hybrid3d_runs.py --devices 1 --out r.json --workdir DIR --scenarios reference
python tests/scenarios/hybrid3d_runs.py --devices 4 --out r.json --workdir DIR --scenarios pp2_dp2,pp2_tp2,...
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import lightning as L
import torch
from common import (  # type: ignore[import-not-found]
    AllStagesRecorder,
    full_state,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from models import HFCausalLM, HFLlama  # type: ignore[import-not-found]

from examples.gpt import GPT
from lightning_dist import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
)
from lightning_dist.parallel.fsdp import fsdp_modules
from lightning_dist.parallel.tensor_parallel import permuted_parameters, to_checkpoint_order

STEPS = 4
AXES = {"pp": "pipeline_parallel_size", "dp": "data_parallel_shard_size", "cp": "context_parallel_size",
        "tp": "tensor_parallel_size", "hsdp": "data_parallel_replicate_size"}  # fmt: skip


def mesh_options(name: str) -> dict[str, int]:
    """``"pp2_dp2_tp2"`` → the strategy's size options (``hsdp2`` is dp_replicate=2 × dp_shard=2)."""
    options = {AXES[axis]: int(size) for axis, size in re.findall(r"([a-z]+)(\d+)", name)}
    options.setdefault("data_parallel_shard_size", 2 if "data_parallel_replicate_size" in options else 1)
    return options


class TiedGPT(GPT):
    """The example GPT with its head tied to a token embedding named ``vocab`` (no known embedding name), registered
    after the head. On a pipeline stage without the head, tensor parallelism cannot tell it is the token embedding
    and leaves it whole, while the last stage shards the head on the vocabulary: the tied copies differ in layout."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        del self.tok_emb
        self.vocab = torch.nn.Embedding(self.hparams.vocab_size, self.hparams.d_model)
        self.head.weight = self.vocab.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.vocab(input_ids) + self.pos_emb(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class FirstBackwardGradients(L.Callback):
    """How many parameters hold a gradient after the first micro-batch's backward: FSDP2 sets them when it reduces,
    and keeps them unsharded and unset while accumulation_sync='last' defers the reduction."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.counts:
            self.counts = [sum(p.grad is not None for p in pl_module.parameters()), len(list(pl_module.parameters()))]


ACCUMULATION = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}  # clipping active at every step
VARIANTS = {  # scenario-name prefix: the Trainer options that change against the plain run (the reference's too)
    "hf": {},  # a stock transformers LlamaForCausalLM (4 heads, 2 KV heads) that shifts the labels itself
    # a stock transformers GPT2LMHeadModel: lm_head tied to the token embedding (a copy on each pipeline stage),
    # clipped at every step (the norm counts the tied gradient once, as one process does)
    "gpt2": {"gradient_clip_val": 0.5},
    "tied": {"gradient_clip_val": 0.5},  # TiedGPT: tied copies laid out differently under pp × tp
    "acc": ACCUMULATION,
    "acclast": ACCUMULATION,  # accumulation_sync="last"; compared with the acc reference
    "wrap": {},  # attention and MLP as FSDP2 units (wrap_regex) instead of the blocks
    "zeropp": {},  # Hybrid3DStrategy(zeropp=True); compared with the plain reference
}
STRATEGY_OPTIONS = {  # scenario-name prefix: the Hybrid3DStrategy options it adds
    "acclast": {"accumulation_sync": "last"},
    "wrap": {"wrap_regex": r"blocks\.\d+\.(attn|mlp)"},
    "zeropp": {"zeropp": True},
}


def _variant(name: str) -> tuple[str, str]:
    """``"acc_pp2_dp2_tp2"`` → ``("acc", "pp2_dp2_tp2")``; no prefix → ``("", name)``."""
    kind, _, rest = name.partition("_")
    return (kind, rest) if kind in VARIANTS else ("", name)


def _run(
    devices: int, strategy: Any, batch_replicas: int, kind: str = ""
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    model, data = make_model_and_data(devices, dp_size=batch_replicas, vocab_size=64)  # tp=2 divides 64 (data: 63)
    if kind == "tied":
        L.seed_everything(1234, verbose=False)
        model = TiedGPT(**model.hparams)
    if kind in ("hf", "gpt2"):
        L.seed_everything(1234, verbose=False)
        model = HFLlama(64) if kind == "hf" else HFCausalLM("gpt2")
    recorder, first = AllStagesRecorder(), FirstBackwardGradients()
    options = VARIANTS.get(kind, {})
    batches = STEPS * options.get("accumulate_grad_batches", 1)
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true", callbacks=[recorder, first]),
        max_steps=STEPS,
        val_check_interval=batches,
        **options,
    )
    trainer.fit(model, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    result = {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "val": metrics}
    state = full_state(model)
    for name, (_, dim, order) in permuted_parameters(model).items():  # GPT-2's fused c_attn, in its own row order
        state[name] = to_checkpoint_order(state[name], dim, order)
    return {**result, "gradients_after_first_backward": first.counts}, state


def reference(kind: str, devices: int, workdir: str) -> dict[str, Any]:
    """One process, the whole batch and sequence: what every mesh must match."""
    result, state = _run(1, "auto", 1, kind)
    torch.save(state, f"{workdir}/{kind + '_' if kind else ''}reference.pt")
    return result


def hybrid(name: str, devices: int, workdir: str) -> dict[str, Any]:
    kind, mesh = _variant(name)
    strategy, replicas = _strategy(mesh, **STRATEGY_OPTIONS.get(kind, {}))
    result, state = _run(devices, strategy, replicas, kind)
    torch.save(state, f"{workdir}/{name}.rank{strategy.global_rank}.pt")  # a pipeline rank holds its stages only
    result["mesh"] = str(strategy.parallel_dims)
    result["local_parameters"] = sum(p.numel() for p in strategy.lightning_module.parameters())
    result["fsdp_units"] = sorted({type(m).__name__ for m in fsdp_modules(strategy.lightning_module)})
    return result


SAVE_AT = 2


def _strategy(name: str, **hybrid_options: Any) -> tuple[Any, int]:
    """A strategy by scenario name (a mesh for hybrid3d, else a single strategy on 4 ranks) and its replica count."""
    single = {
        "fsdp2": (lambda: FSDP2Strategy(), 4),
        "tensor_parallel": (lambda: TensorParallelStrategy(tensor_parallel_size=2, data_parallel_shard_size=2), 2),
        "pipeline": (lambda: PipelineStrategy(data_parallel_shard_size=2), 2),
        "context_parallel": (lambda: ContextParallelStrategy(data_parallel_shard_size=2), 2),
    }
    if name in single:
        make, replicas = single[name]
        return make(), replicas
    options = mesh_options(name)
    return Hybrid3DStrategy(**options, **hybrid_options), options["data_parallel_shard_size"] * options.get(
        "data_parallel_replicate_size", 1
    )


def resume(source: str | None, target: str, devices: int, workdir: str) -> dict[str, Any]:
    """Train under ``target`` from the step-SAVE_AT checkpoint ``source`` saved, to step STEPS (``source=None``:
    train to SAVE_AT and save it). The final parameters are compared with the uninterrupted one-process run."""
    strategy, replicas = _strategy(target)
    model, data = make_model_and_data(devices, dp_size=replicas, vocab_size=64)
    recorder = AllStagesRecorder()
    callbacks = (
        [] if source else [ModelCheckpoint(f"{workdir}/{target}", every_n_train_steps=SAVE_AT, filename="{step}")]
    )
    trainer = L.Trainer(
        **trainer_kwargs(
            devices, strategy=strategy, precision="64-true", limit_val_batches=0, enable_checkpointing=not source
        ),
        max_steps=STEPS if source else SAVE_AT,
        callbacks=[recorder, *callbacks],
    )
    trainer.fit(model, data, ckpt_path=f"{workdir}/{source}/step={SAVE_AT}.ckpt" if source else None)
    torch.save(full_state(model), f"{workdir}/{target}-from-{source}.rank{strategy.global_rank}.pt")
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms}


class _ByName(dict):
    """Scenarios by name: ``reference``/``hf_reference``, a mesh (``pp2_tp2``, ``hf_cp2_tp2``), or a checkpoint
    move ``<target>-from-<source>`` (``pp2_tp2-from-None`` saves, ``fsdp2-from-pp2_tp2`` resumes)."""

    def __missing__(self, name: str) -> Any:
        if name.endswith("reference"):
            return partial(reference, _variant(name)[0])
        if "-from-" in name:
            target, source = name.split("-from-")
            return partial(resume, None if source == "None" else source, target)
        return partial(hybrid, name)


if __name__ == "__main__":
    run_scenario_script(_ByName())
