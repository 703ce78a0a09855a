"""Pure-PyTorch pipeline parity on real processes (gloo, fp64): stages cut from unchanged models against one process.

Every rank builds the same seeded model, keeps a whole copy as the one-process reference (full batch, mean loss),
cuts its own stages from the other copy and runs them through a torch schedule. Rank 0 writes, per case, the largest
difference of the loss, of every gradient and of every parameter after an optimizer step (max over ranks).

python tests/scenarios/pipeline_runs.py --devices 2 --out r.json --scenarios gpt_1f1b,gpt_gpipe
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from lightning_dist.parallel.pipeline import (
    PipelineRunner,
    all_reduce_tied_gradients,
    cut_pipeline_stages,
    find_tied_parameters,
    model_inputs_as_kwargs,
    new_tie_groups,
    plan_stages,
    resolve_stages_per_rank,
    schedule_info,
    stage_ids_for_rank,
)

BATCH, SEQ, VOCAB = 8, 16, 64


def gpt(n_layer: int) -> nn.Module:
    from examples.gpt import GPT

    return GPT(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=n_layer, n_head=4)


def llama(n_layer: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def gpt2(n_layer: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=32, n_layer=n_layer, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def logits_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), labels.flatten())


def hf_loss(output: Any, _target: Any) -> torch.Tensor:
    return output.loss


# name -> (model builder, layers, schedule, optimizer, uses HF labels inside forward)
CASES: dict[str, tuple[Callable[[int], nn.Module], int, str, str, bool]] = {
    "gpt_gpipe": (gpt, 4, "gpipe", "sgd", False),
    "gpt_1f1b": (gpt, 4, "1f1b", "adamw", False),
    "gpt_interleaved_1f1b": (gpt, 4, "interleaved_1f1b", "adamw", False),
    "gpt_looped_bfs": (gpt, 4, "looped_bfs", "sgd", False),
    "gpt_interleaved_zero_bubble": (gpt, 4, "interleaved_zero_bubble", "sgd", False),
    "gpt_zbv_zero_bubble": (gpt, 4, "zbv_zero_bubble", "adamw", False),
    "gpt_dualpipev": (gpt, 4, "dualpipev", "sgd", False),
    "llama_1f1b": (llama, 4, "1f1b", "adamw", True),
    "gpt2_tied_1f1b": (gpt2, 4, "1f1b", "adamw", True),
    "gpt2_tied_zbv_zero_bubble": (gpt2, 4, "zbv_zero_bubble", "sgd", True),
}


def run_case(name: str, rank: int, world: int) -> dict[str, Any]:
    build, n_layer, schedule, optimizer_name, hf = CASES[name]
    torch.manual_seed(0)
    model = build(n_layer).double()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    call_kwargs = {"input_ids": input_ids, "labels": labels} if hf else {"input_ids": input_ids}
    n_microbatches = 4

    # One process, whole batch; the mean over equal micro-batches of their mean losses is the full-batch mean.
    out = reference(**call_kwargs)
    ref_loss = hf_loss(out, None) if hf else logits_loss(out, labels)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters(remove_duplicate=False)}
    make_optimizer(optimizer_name, reference.parameters()).step()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))

    info = schedule_info(schedule)
    per_rank = resolve_stages_per_rank(schedule, None)
    plan = plan_stages(model, world * per_rank)
    ties = find_tied_parameters(model, plan)
    groups = new_tie_groups(ties, [list(range(world))], per_rank, info.placement)
    stage_ids = stage_ids_for_rank(rank, world, per_rank, info.placement)
    inputs = model_inputs_as_kwargs(model, (), call_kwargs)
    parts = cut_pipeline_stages(model, plan, stage_ids, "cpu")
    runner = PipelineRunner(
        parts, stage_ids, plan.num_stages, schedule, n_microbatches, hf_loss if hf else logits_loss
    )
    losses: list[torch.Tensor] = []
    started = time.perf_counter()
    runner.step(inputs, target=labels, losses=losses)
    all_reduce_tied_gradients(model, ties, groups)
    seconds = time.perf_counter() - started

    loss_error = torch.zeros((), dtype=torch.float64)
    if runner.holds_last_stage:
        loss_error = (torch.stack(losses).mean() - ref_loss).abs().detach()
    local = dict(model.named_parameters(remove_duplicate=False))
    grad_error = max((float((p.grad - ref_grads[n]).abs().max()) for n, p in local.items()), default=0.0)
    make_optimizer(optimizer_name, model.parameters()).step()
    param_error = max((float((p.detach() - ref_params[n].detach()).abs().max()) for n, p in local.items()), default=0.0)
    counts = torch.tensor([float(loss_error), grad_error, param_error, len(local)], dtype=torch.float64)
    stats = [counts.clone() for _ in range(world)]
    dist.all_gather(stats, counts)
    total = torch.stack(stats)
    return {
        "loss_error": float(total[:, 0].max()),
        "grad_error": float(total[:, 1].max()),
        "param_error": float(total[:, 2].max()),
        "params_per_rank": [int(c) for c in total[:, 3]],
        "reference_params": len(ref_params),
        "ties": [t.describe() for t in ties],
        "stages": plan.describe(),
        "seconds": seconds,
    }


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def worker(rank: int, world: int, port: int, cases: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {name: run_case(name, rank, world) for name in cases}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default="all")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    cases = list(CASES) if args.scenarios == "all" else args.scenarios.split(",")
    mp.spawn(worker, args=(args.devices, free_port(), cases, args.out), nprocs=args.devices, join=True)


if __name__ == "__main__":
    main()
