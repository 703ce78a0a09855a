"""Expert parallelism's pure-PyTorch core in real processes (gloo, no Lightning): a stock tiny ``MixtralForCausalLM``
in fp64, its experts split over ep ranks, against the same model in one process.

Run as ``python tests/scenarios/expert_parallel_core_runs.py --devices 2 --out result.json``. Every rank builds the
model from one seed, computes the one-process reference on the whole batch itself, then applies expert parallelism
and runs its own half of the batch. Rank 0 writes ``{scenario: {...}}`` as JSON (errors are maxima over ranks).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if "lightning_dist" not in sys.modules:  # the pure-PyTorch layer, without the package root's Lightning imports
    _package = types.ModuleType("lightning_dist")
    _package.__path__ = [str(ROOT / "lightning_dist")]
    sys.modules["lightning_dist"] = _package

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_dist.parallel.expert_parallel import apply_expert_parallel

VOCAB, SEQ, BATCH = 64, 16, 4


def tiny_mixtral(num_experts: int = 4) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=num_experts, num_experts_per_tok=2, max_position_embeddings=SEQ,
        attn_implementation="eager", experts_implementation="eager", router_jitter_noise=0.0,
    )  # fmt: skip
    torch.manual_seed(1234)
    return MixtralForCausalLM(config).double()


def _max_over_world(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def mixtral_fp64(rank: int, world: int) -> dict[str, Any]:
    """One forward and backward: the loss (mean over ranks) and every gradient against one process."""
    model = tiny_mixtral()
    reference = copy.deepcopy(model)
    torch.manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    ref_loss = reference(input_ids=tokens, labels=tokens).loss
    ref_loss.backward()

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    record = apply_expert_parallel(model, mesh)
    mine = tokens.chunk(world)[rank]
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world

    grad_err, expert_grads, local_shapes = 0.0, 0, {}
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):  # an expert weight: its gradient is already the mean over the ep ranks
            grad = param.grad.full_tensor()
            expert_grads += 1
            local_shapes[name] = list(param.to_local().shape)
        else:  # replicated (dense) parameters: averaged over the data-parallel ranks, as DDP or FSDP would
            grad = param.grad.clone()
            dist.all_reduce(grad)
            grad /= world
        grad_err = max(grad_err, float((grad - ref_grads[name]).abs().max()))
    return {
        "loss_diff": _max_over_world(abs(float(mean_loss) - float(ref_loss.detach()))),
        "grad_diff": _max_over_world(grad_err),
        "loss": float(ref_loss.detach()),
        "expert_parameters": expert_grads,
        "local_shapes": local_shapes,
        "record": record.describe(),
    }


SCENARIOS = {"mixtral_fp64": mixtral_fp64}


def _worker(rank: int, world: int, port: int, scenarios: list[str], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result: dict[str, Any] = {}
        for name in scenarios:
            start = time.perf_counter()
            result[name] = SCENARIOS[name](rank, world)
            result[f"{name}_seconds"] = round(time.perf_counter() - start, 2)
        result["lightning_imported"] = any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in sys.modules)
        if rank == 0:
            Path(f"{out}.tmp").write_text(json.dumps(result))
            os.replace(f"{out}.tmp", out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    mp.spawn(_worker, args=(args.devices, _free_port(), scenarios, args.out), nprocs=args.devices, join=True)


if __name__ == "__main__":
    main()
