"""Pure-PyTorch pipeline parity on real processes (gloo, fp64): stages cut from unchanged models against one process.

Every rank builds the same seeded model, keeps a whole copy as the one-process reference (full batch, mean loss),
cuts its own stages from the other copy and runs them through a torch schedule. Rank 0 writes, per case, the largest
difference of the loss, of every gradient and of every parameter after an optimizer step (max over ranks).

python tests/scenarios/pipeline_runs.py --out r.json --scenarios gpt_1f1b,gpt_gpipe_pp4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def gpt2(n_layer: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=32,
        n_layer=n_layer,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def logits_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), labels.flatten())


def hf_loss(output: Any, _target: Any) -> torch.Tensor:
    return output.loss


@dataclass(frozen=True)
class Case:
    """One parity case: a model, a schedule and how many processes it runs on."""

    build: Callable[[int], nn.Module]
    schedule: str
    pp: int = 2
    dp: int = 1
    tp: int = 1
    n_layer: int = 4
    optimizer: str = "adamw"
    hf_labels: bool = False  # the loss comes from the model's own `labels=` path
    meta: bool = False  # built on the meta device, only the local stages materialised


CASES: dict[str, Case] = {
    "gpt_gpipe": Case(gpt, "gpipe", optimizer="sgd"),
    "gpt_1f1b": Case(gpt, "1f1b"),
    "gpt_interleaved_1f1b": Case(gpt, "interleaved_1f1b"),
    "gpt_looped_bfs": Case(gpt, "looped_bfs", optimizer="sgd"),
    "gpt_interleaved_zero_bubble": Case(gpt, "interleaved_zero_bubble", optimizer="sgd"),
    "gpt_zbv_zero_bubble": Case(gpt, "zbv_zero_bubble"),
    "gpt_dualpipev": Case(gpt, "dualpipev", optimizer="sgd"),
    "gpt_1f1b_meta": Case(gpt, "1f1b", meta=True),
    "llama_1f1b": Case(llama, "1f1b", hf_labels=True),
    "gpt2_tied_1f1b": Case(gpt2, "1f1b", hf_labels=True),
    "gpt2_tied_zbv_zero_bubble": Case(gpt2, "zbv_zero_bubble", optimizer="sgd", hf_labels=True),
    "gpt_gpipe_pp4": Case(gpt, "gpipe", pp=4, optimizer="sgd"),
    "gpt_1f1b_pp4": Case(gpt, "1f1b", pp=4),
    "gpt_1f1b_pp2_dp2_fsdp": Case(gpt, "1f1b", pp=2, dp=2),
    "gpt_1f1b_pp2_tp2": Case(gpt, "1f1b", pp=2, tp=2),
}


def run_case(name: str, rank: int, world: int) -> dict[str, Any]:
    case = CASES[name]
    torch.manual_seed(0)
    with torch.device("meta") if case.meta else nullcontext():
        model = case.build(case.n_layer).double()
    torch.manual_seed(0)
    reference = case.build(case.n_layer).double()
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    n_microbatches = 4 // case.dp

    # One process, whole batch; the mean over equal micro-batches of their mean losses is the full-batch mean.
    out = reference(**({"input_ids": input_ids, "labels": labels} if case.hf_labels else {"input_ids": input_ids}))
    ref_loss = hf_loss(out, None) if case.hf_labels else logits_loss(out, labels)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters(remove_duplicate=False)}
    make_optimizer(case.optimizer, reference.parameters()).step()
    ref_params = {n: p.detach().clone() for n, p in reference.named_parameters(remove_duplicate=False)}

    mesh = init_device_mesh("cpu", (case.pp, case.dp, case.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    rows = slice(dp_rank * BATCH // case.dp, (dp_rank + 1) * BATCH // case.dp)  # this replica's share
    call_kwargs = {"input_ids": input_ids[rows]} | ({"labels": labels[rows]} if case.hf_labels else {})

    info = schedule_info(case.schedule)
    per_rank = resolve_stages_per_rank(case.schedule, None)
    plan = plan_stages(model, case.pp * per_rank)
    ties = find_tied_parameters(model, plan)
    inner = case.dp * case.tp  # ranks are row-major over (pp, dp, tp)
    pp_groups = [[p * inner + i for p in range(case.pp)] for i in range(inner)]
    groups = new_tie_groups(ties, pp_groups, per_rank, info.placement)
    stage_ids = stage_ids_for_rank(pp_rank, case.pp, per_rank, info.placement)
    inputs = model_inputs_as_kwargs(model, (), call_kwargs)
    parts = cut_pipeline_stages(model, plan, stage_ids, "cpu")
    if case.meta:  # materialise this rank's stages only, then load values as a checkpoint would
        for part in parts:
            part.to_empty(device="cpu")
        local_state = model.state_dict()
        model.load_state_dict({k: reference_initial(case)[k] for k in local_state}, strict=True)
    if case.tp > 1:  # tensor parallel inside each stage: the MLP of every local block, column then row
        for part in parts:
            for block in part.modules():
                if type(block).__name__ == "Block":
                    parallelize_module(block.mlp, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if case.dp > 1:
        for part in parts:
            for block in part.modules():
                if type(block).__name__ == "Block":
                    fully_shard(block, mesh=mesh["dp"])
            fully_shard(part, mesh=mesh["dp"])
    runner = PipelineRunner(
        parts,
        stage_ids,
        plan.num_stages,
        case.schedule,
        n_microbatches,
        hf_loss if case.hf_labels else logits_loss,
        group=mesh["pp"].get_group(),
    )
    losses: list[torch.Tensor] = []
    started = time.perf_counter()
    runner.step(inputs, target=labels[rows], losses=losses)
    all_reduce_tied_gradients(model, ties, groups)
    seconds = time.perf_counter() - started

    loss_error = torch.zeros((), dtype=torch.float64)
    if runner.holds_last_stage:
        loss = torch.stack(losses).mean().detach()
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        loss_error = (loss / case.dp - ref_loss.detach()).abs()
    local = dict(model.named_parameters(remove_duplicate=False))
    grad_error = max((float((_full(p.grad) - ref_grads[n]).abs().max()) for n, p in local.items()), default=0.0)
    make_optimizer(case.optimizer, model.parameters()).step()
    local_bytes = sum(_local(p).numel() * p.element_size() for p in model.parameters())

    # Evaluation of a batch of another shape (new torch stages, same stage modules) after the step.
    eval_rows = slice(rows.start // 2, rows.start // 2 + BATCH // case.dp // 2)
    eval_kwargs = {"input_ids": input_ids[eval_rows]} | ({"labels": labels[eval_rows]} if case.hf_labels else {})
    eval_losses: list[torch.Tensor] = []
    runner.eval(model_inputs_as_kwargs(model, (), eval_kwargs), target=labels[eval_rows], losses=eval_losses)
    eval_error = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        ref_eval = reference(
            **({"input_ids": input_ids[: BATCH // 2]} | ({"labels": labels[: BATCH // 2]} if case.hf_labels else {}))
        )
        ref_eval_loss = hf_loss(ref_eval, None) if case.hf_labels else logits_loss(ref_eval, labels[: BATCH // 2])
    if runner.holds_last_stage:
        eval_loss = torch.stack(eval_losses).mean().detach()
        dist.all_reduce(eval_loss, group=mesh["dp"].get_group())
        eval_error = (eval_loss / case.dp - ref_eval_loss).abs()
    param_error = max((float((_full(p.detach()) - ref_params[n]).abs().max()) for n, p in local.items()), default=0.0)
    stats = torch.tensor(
        [float(loss_error), grad_error, param_error, len(local), local_bytes, float(eval_error)], dtype=torch.float64
    )
    gathered = [stats.clone() for _ in range(world)]
    dist.all_gather(gathered, stats)
    total = torch.stack(gathered)
    return {
        "loss_error": float(total[:, 0].max()),
        "grad_error": float(total[:, 1].max()),
        "param_error": float(total[:, 2].max()),
        "eval_error": float(total[:, 5].max()),
        "params_per_rank": [int(c) for c in total[:, 3]],
        "param_bytes_per_rank": [int(c) for c in total[:, 4]],
        "reference_params": len(ref_params),
        "reference_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
        "ties": [t.describe() for t in ties],
        "stages": plan.describe(),
        "seconds": seconds,
    }


def reference_initial(case: Case) -> dict[str, torch.Tensor]:
    """The seeded initial values, as a checkpoint would hold them (keys include tied names)."""
    torch.manual_seed(0)
    return case.build(case.n_layer).double().state_dict()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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


def bubble_worker(rank: int, world: int, port: int, n_microbatches: int, out: str) -> None:
    """The bubble instrument of ``benchmarks/studies/pipeline.py`` (``python -m benchmarks.pipeline`` prints it with the
    formulas); kept here as ``--bubble M`` for a quick look without Lightning."""
    from benchmarks.studies import measure_bubble

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = measure_bubble(rank, world, n_microbatches)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _world(case: Case) -> int:
    return case.pp * case.dp * case.tp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default="all")
    parser.add_argument("--bubble", type=int, default=0, help="measure the bubble with this many micro-batches")
    args = parser.parse_args()
    if args.bubble:
        from benchmarks.studies import GPT_BIG

        GPT_BIG()
        mp.start_processes(
            bubble_worker, args=(2, free_port(), args.bubble, args.out), nprocs=2, join=True, start_method="fork"
        )
        return
    names = list(CASES) if args.scenarios == "all" else args.scenarios.split(",")
    # Import the models once here; forked workers inherit the modules instead of importing them again.
    for builder in {CASES[n].build for n in names}:
        builder(2)
    results: dict[str, Any] = {}
    for world in sorted({_world(CASES[n]) for n in names}):
        batch = [n for n in names if _world(CASES[n]) == world]
        out = f"{args.out}.{world}"
        mp.start_processes(worker, args=(world, free_port(), batch, out), nprocs=world, join=True, start_method="fork")
        results.update(json.loads(Path(out).read_text()))
        os.remove(out)
    Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
