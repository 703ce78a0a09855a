"""``lightning-dist plan --devices N ...``: rank every mesh of N devices for a model, and recommend one.

    lightning-dist plan --model examples.gpt.GPT --init-args '{"n_layer": 8}' --devices 8 --seq-len 1024 \\
        --micro-batch 4 --global-batch 64 --memory-gib 80
    lightning-dist plan --model transformers.LlamaForCausalLM --config-class transformers.LlamaConfig \\
        --init-args '{"hidden_size": 4096, ...}' --devices 64 --nodes 8 --seq-len 8192 --global-batch 512

The model is built on the meta device (no memory), so an 8B model plans on a laptop. For each mesh it prints the
per-rank memory (parameters, gradients, optimizer state, activations, FSDP buffers) and the bytes each rank sends per
step inside and across nodes, with the reason a mesh is ruled out; then the recommendation and one line of reasons.
"""

from __future__ import annotations

import argparse

from lightning_dist.commands.model_arguments import build_on_meta, json_object
from lightning_dist.planning.estimate import COMPUTE_BYTES, GIB, OPTIMIZER_STATES
from lightning_dist.planning.recommend import NoMeshFits, plan_meshes
from lightning_dist.planning.search import milliseconds


def wants_mesh(argv: list[str]) -> bool:
    """Whether ``lightning-dist plan`` was asked for meshes (``--devices``) rather than a TP or pipeline plan."""
    return any(a == "--devices" or a.startswith("--devices=") for a in argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-dist plan", description="Rank the meshes of N devices for a model.")
    p.add_argument("--model", required=True, help="class path of the model (LightningModule or nn.Module)")
    p.add_argument("--init-args", default="{}", help="JSON object of the constructor arguments")
    p.add_argument("--config-class", help="class path of a config built from --init-args (Hugging Face models)")
    p.add_argument("--devices", type=int, required=True, help="devices per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--memory-gib", type=float, default=80.0, help="memory per device")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, default=1, help="samples per rank per micro-step")
    p.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--precision", default="bf16-mixed", choices=sorted(COMPUTE_BYTES))
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument(
        "--expert-parallel-size",
        type=_ep_size,
        default=None,
        help="mixture of experts: keep this ep (an int, or 'auto' for all of dp_shard × cp); default: the planner"
        " chooses it",
    )
    p.add_argument("--top", type=int, default=12, help="meshes to list")
    return p


def _ep_size(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive int nor 'auto'")
    return int(text)


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    # on the meta device: plan_meshes casts its own meta copy to the compute dtype
    model = build_on_meta(args.model, json_object(args.init_args), args.config_class)
    world = args.devices * args.nodes
    planned = plan_meshes(
        model,
        world,
        args.nodes,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        device_memory_gib=args.memory_gib,
        precision=args.precision,
        optimizer=args.optimizer,
        activation_checkpointing=args.activation_checkpointing,
        expert_parallel_size=args.expert_parallel_size,
    )
    facts, ranked = planned.facts, planned.candidates
    experts = (
        f" ({facts.num_experts} experts per MoE layer, top-{facts.top_k}: {facts.active_params / 1e6:.1f} M active)"
        if facts.num_experts
        else ""
    )
    print(
        f"# {args.model}: {facts.total_params / 1e6:.1f} M parameters{experts}, {facts.blocks} blocks; {world} devices"
        f" ({args.nodes} node(s) × {args.devices}), {args.memory_gib:g} GiB each; seq {args.seq_len},"
        f" micro-batch {args.micro_batch}, global batch {args.global_batch}, {args.precision}, {args.optimizer}"
        f"{', activation checkpointing' if args.activation_checkpointing else ''}"
    )
    print("| mesh | params | grads | optimizer | activations | buffers | total GiB | GB sent in / across nodes"
          " | est. step | ruled out because |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in ranked[: args.top]:
        e = c.estimate
        inside = sum(i for i, _ in e.comm.values()) / 1e9
        across = sum(a for _, a in e.comm.values()) / 1e9
        cells = [e.params, e.grads, e.optimizer, e.activations, e.buffers, e.memory]
        print(
            f"| {c.mesh} | " + " | ".join(f"{v / GIB:.2f}" for v in cells)
            + f" | {inside:.2f} / {across:.2f} | {milliseconds(c.step_seconds)} | {'; '.join(c.problems) or '-'} |"
        )  # fmt: skip
    try:
        _, why = planned.best()
    except NoMeshFits:
        print("\nNo mesh fits: add devices, use activation checkpointing, a smaller micro-batch or a lower precision.")
        raise SystemExit(1) from None
    print(f"\nRecommended: {why}.")
