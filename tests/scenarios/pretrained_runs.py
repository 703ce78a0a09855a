"""Pretrained safetensors weights loaded into an FSDP2-sharded model built on the meta device (issue 42), 2 processes,
pure PyTorch (no Lightning).

The test writes the folders first (``<workdir>/llama``: a bf16 ``LlamaForCausalLM`` in several shards,
``<workdir>/gpt2``: a tied ``GPT2LMHeadModel``). Each scenario builds the model from the folder's ``config.json`` on
the meta device in fp64, shards it over ``dp_shard`` (fsdp2: each decoder block a unit, then the root), materializes
it as the strategies do, and loads the folder with :func:`load_pretrained`.

- ``fsdp2_llama``: right after the load, every full tensor (``full_tensor()``) equals the file's, converted to fp64,
  exactly, and each rank read only its half of the elements (counted at ``safetensors.safe_open``); then 3 AdamW steps (each rank half of the batch) against one process that called ``from_pretrained(...,
  dtype=torch.float64)`` on the whole batch: the largest loss and parameter differences.
- ``fsdp2_gpt2_tied``: the same load of GPT-2, whose file holds ``transformer.wte.weight`` only: the head stays the
  embedding's tensor, and the values equal the file's.

python tests/scenarios/pretrained_runs.py --devices 2 --out r.json --workdir DIR --scenarios fsdp2_llama,...
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pure_torch import run_pure_torch_scenarios  # type: ignore[import-not-found]  (before lightning_dist: see there)
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dist.checkpoint.pretrained import load_pretrained
from lightning_dist.parallel.fsdp import FSDPConfig
from lightning_dist.parallel.materialize import materialize
from lightning_dist.parallel.mesh import ParallelDims
from lightning_dist.parallel.parallelize import ParallelizeConfig, parallelize

WORKDIR_VARIABLE = "PRETRAINED_RUNS_WORKDIR"
BATCH, SEQ, STEPS = 4, 16, 3


def _folder(name: str) -> Path:
    return Path(os.environ[WORKDIR_VARIABLE]) / name


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _sharded_from_config(folder: Path, world: int) -> nn.Module:
    """The model of ``folder``'s config, built on the meta device in fp64, fsdp2-sharded and materialized."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64)
    blocks = model.get_decoder().layers if hasattr(model.get_decoder(), "layers") else model.get_decoder().h
    units = [(f"block.{i}", block) for i, block in enumerate(blocks)]
    mesh = ParallelDims(dp_shard=world).build_mesh("cpu")
    parallelize(model, mesh, ParallelizeConfig(units=units, fsdp=FSDPConfig()))
    materialize(model, torch.device("cpu"), dist.get_rank())
    return model


def _equal_to_file(model: nn.Module, folder: Path) -> dict[str, Any]:
    """Which of the file's tensors differ from the model's (full tensors), and how many were compared."""
    state = {name: _full(tensor) for name, tensor in model.state_dict().items()}
    files = _file_tensors(folder)
    differ = [key for key, value in files.items() if not torch.equal(state[key], value.to(torch.float64))]
    return {"compared": len(files), "differ": differ, "dtypes": sorted({str(v.dtype) for v in files.values()})}


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def _train(model: nn.Module, batches: list[torch.Tensor], rank: int, world: int) -> list[float]:
    """``STEPS`` AdamW steps; each rank takes its share of each batch; the losses averaged over the ranks."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches:
        share = batch.chunk(world)[rank]
        logits = model(input_ids=share[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), share[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    return losses


class CountedReads:
    """How many elements the slices read through ``safetensors.safe_open`` hold (DCP's reader opens the files
    through it), while :func:`counted_reads` is active."""

    def __init__(self) -> None:
        self.elements = 0


@contextmanager
def counted_reads() -> Iterator[CountedReads]:
    import safetensors

    counter, real = CountedReads(), safetensors.safe_open

    @contextmanager
    def counted_open(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with real(*args, **kwargs) as handle:
            yield _CountedHandle(handle, counter)

    safetensors.safe_open = counted_open
    try:
        yield counter
    finally:
        safetensors.safe_open = real


class _CountedHandle:
    def __init__(self, handle: Any, counter: CountedReads) -> None:
        self.handle, self.counter = handle, counter

    def get_slice(self, key: str) -> Any:
        return _CountedSlice(self.handle.get_slice(key), self.counter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


class _CountedSlice:
    def __init__(self, piece: Any, counter: CountedReads) -> None:
        self.piece, self.counter = piece, counter

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self.piece[index]
        self.counter.elements += tensor.numel()
        return tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.piece, name)


def fsdp2_llama(rank: int, world: int) -> dict[str, Any]:
    import transformers

    folder = _folder("llama")
    model = _sharded_from_config(folder, world)
    with counted_reads() as reads:
        report = load_pretrained(model, folder)
    result: dict[str, Any] = {"prefix": report.prefix, "loaded": report.loaded, **_equal_to_file(model, folder)}
    read_by_rank: list[Any] = [None] * world
    dist.all_gather_object(read_by_rank, reads.elements)
    result["elements_read"] = read_by_rank
    result["elements_in_file"] = sum(t.numel() for t in _file_tensors(folder).values())
    inv_freq = [_full(b) for name, b in model.named_buffers() if name.endswith("inv_freq")]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    reference_inv_freq = [b for name, b in reference.named_buffers() if name.endswith("inv_freq")]
    result["inv_freq_equal"] = all(torch.equal(a, b) for a, b in zip(inv_freq, reference_inv_freq, strict=True))
    batches = _batches()
    losses = _train(model, batches, rank, world)
    reference_losses = _train(reference, batches, 0, 1)
    final = {name: _full(p) for name, p in model.named_parameters()}
    result["losses"] = losses
    result["loss_diff"] = max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True))
    result["param_diff"] = max(float((final[n] - p.detach()).abs().max()) for n, p in reference.named_parameters())
    return result


def fsdp2_gpt2_tied(rank: int, world: int) -> dict[str, Any]:
    folder = _folder("gpt2")
    model = _sharded_from_config(folder, world)
    report = load_pretrained(model, folder)
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    return {
        "tied": {key: list(names) for key, names in report.tied.items()},
        "same_tensor": head is embedding,
        "head_in_file": "lm_head.weight" in _file_tensors(folder),
        **_equal_to_file(model, folder),
    }


SCENARIOS = {"fsdp2_llama": fsdp2_llama, "fsdp2_gpt2_tied": fsdp2_gpt2_tied}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--workdir", required=True)
    os.environ[WORKDIR_VARIABLE] = parser.parse_known_args()[0].workdir  # the spawned ranks inherit it
    run_pure_torch_scenarios(SCENARIOS, 2)
