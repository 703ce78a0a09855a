"""Hugging Face models as users build them: under ``trainer.init_module(empty_init=True)`` (meta device, materialized
after sharding) and with their default config (``use_cache=True``), 2 processes.

- ``empty_init_<kind>`` (fsdp2; ``llama``, ``gpt2``, ``qwen3``, ``mixtral``), ``tp_llama`` (tensor_parallel, tp=2),
  ``pp_llama`` (pipeline, pp=2): once set up, the fresh init's facts (no NaN, norm weights one, ``inv_freq`` the
  model's own, each parameter's spread that of a normal build, the ranks' halves of the embedding different); then
  the weights of a normal build (seed 7) are loaded and the first loss is compared with that build's, on the same
  batches, in fp64. Validation after the step records the ``use_cache`` each step saw.
- ``compile_default`` / ``compile_no_cache``: fsdp2 ``compile`` with a backend that records each graph, on the
  default Llama config and on one with ``use_cache=False``.
- ``first_loss_ignore`` / ``_skip`` / ``_stop``: a plain model whose ``Gain`` module has no ``reset_parameters``,
  built under ``empty_init=True``: what each ``on_nonfinite`` setting says about the first loss.

python tests/scenarios/hf_init_runs.py --devices 2 --out r.json --workdir DIR --scenarios empty_init_llama,...
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import SEQ_LEN, LogLines, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from models import tiny_hf_causal_lm as tiny  # type: ignore[import-not-found]
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from examples.data import TextDataModule
from lightning_dist import FSDP2Strategy, PipelineStrategy, TensorParallelStrategy
from lightning_dist.parallel.runtime.nonfinite import NonFiniteError

WEIGHTS_SEED = 7
BATCH = 4  # samples per rank and step


class HFModule(L.LightningModule):
    """A stock Hugging Face causal LM in a plain LightningModule; the loss from its logits. Records the ``use_cache``
    its config holds in each kind of step."""

    def __init__(self, kind: str, **config: Any) -> None:
        super().__init__()
        self.model = tiny(kind, **config)
        self.use_cache_seen: dict[str, list[bool]] = {"train": [], "val": []}

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.use_cache_seen["train"].append(self.model.config.use_cache)
        return self._loss(batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.use_cache_seen["val"].append(self.model.config.use_cache)
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def _fresh_init_facts(module: HFModule, reference: nn.Module) -> dict[str, Any]:
    """What the materialized model holds before any weights are loaded, against a normal build, over every rank's
    parameters (pipeline stages hold different ones). Collective."""
    ref_params, ref_buffers = dict(reference.named_parameters()), dict(reference.named_buffers())
    facts: dict[str, Any] = {"nan": [], "norms_one": [], "inv_freq_equal": {}, "spread": {}}
    for name, param in module.model.named_parameters():
        full = _full(param)
        facts["nan"] += [name] if not torch.isfinite(full).all() else []
        if full.dim() == 1 and name.endswith("weight"):  # the norms' weights
            facts["norms_one"].append(bool((full == 1).all()))
        elif full.numel() >= 256:
            facts["spread"][name] = float(full.std() / ref_params[name].detach().std())
    for name, buffer in module.model.named_buffers():
        if "inv_freq" in name:
            facts["inv_freq_equal"][name] = bool(torch.equal(_full(buffer).double(), ref_buffers[name].double()))
    try:  # on the pipeline stage that holds both
        embedding = _full(module.model.get_input_embeddings().weight)
        half, pad = embedding.shape[0] // 2, module.model.config.pad_token_id
        facts["embedding_halves_differ"] = not torch.equal(embedding[:half], embedding[half : 2 * half])
        facts["padding_row"] = None if pad is None else float(embedding[pad].abs().max())
        facts["tied"] = module.model.get_output_embeddings().weight is module.model.get_input_embeddings().weight
    except AttributeError:
        pass
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, facts)
    merged: dict[str, Any] = {"nan": [], "norms_one": [], "inv_freq_equal": {}, "spread": {}}
    for rank_facts in gathered:
        for key, value in rank_facts.items():
            if isinstance(value, list):
                merged[key] += value
            elif isinstance(value, dict):
                merged[key].update(value)
            else:
                merged.setdefault(key, value)
    return merged


class LoadAtStart(L.Callback):
    """At train start: the fresh init's facts, then the weights of ``reference`` loaded into the sharded model."""

    def __init__(self, reference: nn.Module) -> None:
        self.reference = reference
        self.facts: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.facts = _fresh_init_facts(pl_module, self.reference)  # type: ignore[arg-type]
        state = {k: v.to(torch.float64) for k, v in self.reference.state_dict().items()}
        set_model_state_dict(pl_module.model, state, options=StateDictOptions(full_state_dict=True, strict=False))


class FirstLosses(L.Callback):
    """The first step's loss (averaged over the ranks that share it) and the reference model's on the same batches."""

    def __init__(self, reference: nn.Module) -> None:
        self.reference = reference.to(torch.float64)
        self.losses: list[float] = []
        self.reference_losses: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        with torch.no_grad():
            logits = self.reference(input_ids=batch["input_ids"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        self.reference_losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))


def _data(samples_per_rank: int = 2 * BATCH) -> TextDataModule:
    return TextDataModule(seq_len=SEQ_LEN, batch_size=BATCH, train_samples=2 * samples_per_rank, val_samples=BATCH)


def _empty_init_run(devices: int, kind: str, strategy: Any, save_to: str | None = None) -> dict[str, Any]:
    L.seed_everything(1234, verbose=False)
    torch.manual_seed(WEIGHTS_SEED)
    reference = tiny(kind)  # the same weights on every rank: a normal build
    load, first = LoadAtStart(reference), FirstLosses(tiny(kind))
    first.reference.load_state_dict(reference.state_dict())
    log = LogLines("materialized")
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy, precision="64-true", limit_val_batches=1),
                        max_steps=1, val_check_interval=1, callbacks=[load, first])  # fmt: skip
    with trainer.init_module(empty_init=True):
        module = HFModule(kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, _data())
    log.close()
    if save_to is not None:  # exported by tests/test_hf_init.py (issue 42)
        trainer.save_checkpoint(save_to)
    return {
        "checkpoint": save_to,
        **load.facts,
        "losses": first.losses,
        "reference_losses": first.reference_losses,
        "use_cache_seen": module.use_cache_seen,
        "log": log.lines,
        "warnings": [
            str(w.message) for w in caught if "empty_init" in str(w.message) or "not finite" in str(w.message)
        ],
    }


# ---------------------------------------------------------------------------------------------- compile
class GraphRecorder:
    """A ``torch.compile`` backend that records the operations of each graph it is given and runs it eagerly."""

    def __init__(self) -> None:
        self.graphs: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs.append(sum(node.op == "call_function" for node in gm.graph.nodes))
        return gm.forward


def _compiled_run(devices: int, **config: Any) -> dict[str, Any]:
    L.seed_everything(1234, verbose=False)
    torch._dynamo.reset()
    recorder = GraphRecorder()
    log = LogLines("key/value cache")
    strategy = FSDP2Strategy(compile={"backend": recorder})
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy, precision="32-true", limit_val_batches=0),
                        max_steps=2)  # fmt: skip
    trainer.fit(HFModule("llama", **config), _data())
    log.close()
    return {"graphs": recorder.graphs, "log": log.lines}


# ---------------------------------------------------------------------------------------------- the first loss
class Gain(nn.Module):
    """A learned per-feature scale, set to one in the constructor, with no ``reset_parameters``."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class GainModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.gain = Gain(32)
        self.head = nn.Linear(32, 64)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.head(self.gain(self.embed(batch["input_ids"])))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _first_loss_run(devices: int, mode: str) -> dict[str, Any]:
    L.seed_everything(1234, verbose=False)
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=FSDP2Strategy(on_nonfinite=mode), limit_val_batches=0),
                        max_steps=2)  # fmt: skip
    with trainer.init_module(empty_init=True):
        module = GainModel()
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, _data())
        except NonFiniteError as err:
            error = str(err)
    return {
        "warnings": [str(w.message) for w in caught if "empty_init" in str(w.message) or "finite" in str(w.message)],
        "error": error,
        "global_step": trainer.global_step,
        "rank": int(os.environ.get("LOCAL_RANK", "0")),
    }


def _fsdp2_run(kind: str) -> Any:
    return lambda devices, workdir: _empty_init_run(devices, kind, FSDP2Strategy(), _saved(kind, workdir))


def _saved(kind: str, workdir: str, strategy: str = "fsdp2") -> str | None:
    """Where a Llama run saves its checkpoint, for the export test."""
    return f"{workdir}/{kind}_{strategy}" if kind == "llama" else None


def _first_loss(mode: str) -> Any:
    return lambda devices, workdir: _first_loss_run(devices, mode)


SCENARIOS = {
    **{f"empty_init_{kind}": _fsdp2_run(kind) for kind in ("llama", "gpt2", "qwen3", "mixtral")},
    "tp_llama": lambda devices, workdir: _empty_init_run(
        devices, "llama", TensorParallelStrategy(tensor_parallel_size=devices), _saved("llama", workdir, "tp")
    ),
    "pp_llama": lambda devices, workdir: _empty_init_run(
        devices, "llama", PipelineStrategy(), _saved("llama", workdir, "pp")
    ),
    "compile_default": lambda devices, workdir: _compiled_run(devices),
    "compile_no_cache": lambda devices, workdir: _compiled_run(devices, use_cache=False),
    **{f"first_loss_{mode}": _first_loss(mode) for mode in ("ignore", "skip", "stop")},
}


def _timed(run: Any) -> Any:
    def timed(devices: int, workdir: str) -> dict[str, Any]:
        start = time.monotonic()
        return {**run(devices, workdir), "seconds": round(time.monotonic() - start, 1)}

    return timed


if __name__ == "__main__":
    run_scenario_script({name: _timed(run) for name, run in SCENARIOS.items()})
