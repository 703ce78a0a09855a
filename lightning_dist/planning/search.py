"""Every mesh of ``world`` ranks, what rules each out, and which one to use.

A mesh is ruled out when a size does not divide what it splits (heads and KV heads by tp, the vocabulary by tp, the
sequence by 2·cp, the blocks by pp, the global batch by the data-parallel ranks times the micro-batch), when tp
would span nodes, or when its estimated memory does not fit the device. The rest are ranked by an estimated step
time: compute (6 · parameters · tokens, 8 with activation checkpointing, at 40% of a 989 TFLOP/s peak, a mixture of
experts counting the experts its tokens use; a pipeline at the pace of its heaviest stage) stretched by the pipeline
bubble, FSDP/HSDP traffic hidden behind compute up to its length, and tensor-, context-, expert- (all-to-all) and
pipeline-parallel traffic exposed. Traffic costs its bytes over the link's bandwidth
plus a latency per collective, send and ring step (:class:`.estimate.Hardware`): a small model's many small messages
are what its step waits on.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from lightning_dist.parallel.mesh import ParallelDims
from lightning_dist.planning.estimate import GIB, Estimate, Hardware, Workload, estimate
from lightning_dist.planning.model_facts import ActivationFacts, ModelFacts

MEMORY_HEADROOM = 0.9  # of the device memory, for the allocator's fragmentation and the framework


@dataclass
class Candidate:
    mesh: ParallelDims
    estimate: Estimate
    problems: list[str]
    step_seconds: float

    @property
    def feasible(self) -> bool:
        return not self.problems


def meshes(world: int, num_experts: int = 0, ep: int | str | None = None) -> list[ParallelDims]:
    """Every assignment of ``world`` ranks to the five axes (sizes multiplying to ``world``), and for a model of
    ``num_experts`` routed experts per layer every expert-parallel size that divides both them and dp_shard × cp.

    ``ep``: ``None`` lets the planner choose, an int keeps that size (meshes it cannot divide are left out), ``"auto"``
    takes all of dp_shard × cp.
    """
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    found = []
    for pp, rep, shard, cp in itertools.product(divisors, repeat=4):
        rest = pp * rep * shard * cp
        if world % rest:
            continue
        fsdp = shard * cp
        if ep == "auto":
            sizes = [fsdp]
        elif isinstance(ep, int):
            sizes = [ep] if fsdp % ep == 0 else []
        else:
            sizes = [
                e for e in range(1, fsdp + 1) if fsdp % e == 0 and (e == 1 or num_experts and num_experts % e == 0)
            ]
        found += [ParallelDims(pp, rep, shard, cp, world // rest, ep=e) for e in sizes]
    return found


def problems_of(facts: ModelFacts, mesh: ParallelDims, workload: Workload, hardware: Hardware) -> list[str]:
    """Why ``mesh`` cannot run this model and workload (empty: it can), before memory."""
    found = []
    if mesh.tp > 1:
        if facts.heads and facts.heads % mesh.tp:
            found.append(f"tp={mesh.tp} does not divide the {facts.heads} heads")
        kv = facts.kv_heads
        if kv and kv % mesh.tp and mesh.tp % kv:
            found.append(f"tp={mesh.tp} and the {kv} KV heads do not divide one another")
        if facts.vocab and facts.vocab % mesh.tp:
            found.append(f"tp={mesh.tp} does not divide the vocabulary of {facts.vocab}")
        if mesh.tp > hardware.devices_per_node:
            found.append(f"tp={mesh.tp} would span nodes of {hardware.devices_per_node} devices")
    if mesh.ep > 1 and facts.num_experts % mesh.ep:
        found.append(f"ep={mesh.ep} does not divide the {facts.num_experts} experts")
    if mesh.cp > 1 and workload.seq_len % (2 * mesh.cp):
        found.append(f"2·cp={2 * mesh.cp} does not divide the sequence of {workload.seq_len}")
    if mesh.pp > facts.blocks:
        found.append(f"pp={mesh.pp} is more stages than the {facts.blocks} blocks")
    per_step = mesh.batch * workload.micro_batch
    if workload.global_batch % per_step:
        found.append(f"the global batch {workload.global_batch} is not a multiple of dp·micro_batch={per_step}")
    elif mesh.pp > 1 and workload.global_batch // per_step < mesh.pp:
        found.append(f"{workload.global_batch // per_step} micro-batches cannot fill {mesh.pp} stages")
    return found


def step_seconds(facts: ModelFacts, est: Estimate, workload: Workload, hardware: Hardware, flops: float) -> float:
    mesh = est.mesh
    tokens = workload.global_batch * workload.seq_len
    flops_per_token = 6 + 2 * workload.checkpointed_fraction  # a checkpointed block runs its forward twice
    compute = flops_per_token * facts.active_params * tokens / mesh.world_size / flops
    if mesh.pp > 1:  # the schedule runs at the pace of the heaviest stage, not of the average one
        active_block = facts.block_params - (facts.total_params - facts.active_params) / facts.blocks
        heaviest = math.ceil(facts.blocks / mesh.pp) * active_block
        heaviest += max(facts.first_stage_params, facts.last_stage_params)
        compute *= mesh.pp * heaviest / facts.active_params
    microbatches = max(1, workload.global_batch // (mesh.batch * workload.micro_batch))
    bubble = (mesh.pp - 1) / (microbatches + mesh.pp - 1)
    seconds = est.axis_seconds(hardware)
    hidden = sum(seconds.pop(axis, 0.0) for axis in ("dp_shard", "dp_replicate", "ep_fsdp", "ep_replicas"))
    busy = compute / (1 - bubble) if bubble < 1 else float("inf")
    if mesh.pp > 1:  # the schedule's forward and backward actions of every micro-batch, on the busiest rank
        busy += 2 * microbatches * hardware.pipeline_action_s
    return max(busy, hidden) + sum(seconds.values())


def plan(
    facts: ModelFacts,
    activations_at: Callable[[int], ActivationFacts | None],
    workload: Workload,
    hardware: Hardware,
    world: int,
    flops: float = 989e12 * 0.4,
    ep: int | str | None = None,
) -> list[Candidate]:
    """Every mesh, best first: feasible ones by estimated step time, then the others by memory.

    ``activations_at(cp)`` returns the activation counts at the local sequence ``seq_len / cp`` (or ``None``);
    ``ep`` as in :func:`meshes`.
    """
    cache: dict[int, ActivationFacts | None] = {}
    candidates = []
    for mesh in meshes(world, facts.num_experts, ep):
        found = problems_of(facts, mesh, workload, hardware)
        if mesh.cp not in cache and not any("cp" in p for p in found):
            cache[mesh.cp] = activations_at(mesh.cp)
        est = estimate(facts, cache.get(mesh.cp), mesh, workload, hardware)
        if est.memory > MEMORY_HEADROOM * hardware.memory_bytes:
            found.append(
                f"needs {est.memory / GIB:.1f} GiB of {hardware.memory_bytes / GIB:.0f} GiB"
                f" ({MEMORY_HEADROOM:.0%} usable)"
            )
        candidates.append(Candidate(mesh, est, found, step_seconds(facts, est, workload, hardware, flops)))
    return sorted(candidates, key=lambda c: (not c.feasible, *(_rank_key(c) if c.feasible else (c.estimate.memory,))))


def _rank_key(c: Candidate) -> tuple[float, float, float]:
    """Shortest step first; among equals (compute-bound meshes), fewer bytes across nodes, then less memory. Steps
    are compared to 4 significant digits (not to a fixed 0.1 ms, under which every mesh of a small model ties)."""
    return float(f"{c.step_seconds:.4g}"), sum(a for _, a in c.estimate.comm.values()), c.estimate.memory


def reason(best: Candidate, hardware: Hardware) -> str:
    """One line on why ``best`` was chosen."""
    est = best.estimate
    across = sum(a for _, a in est.comm.values())
    exposed = [axis for axis in ("tp", "cp", "ep", "pp") if axis in est.comm]
    if math.isinf(hardware.memory_bytes):
        fits = f"needs {est.memory / GIB:.1f} GiB per device (memory not checked)"
    else:
        fits = f"fits in {est.memory / GIB:.1f} of {hardware.memory_bytes / GIB:.0f} GiB per device"
    return (
        f"{best.mesh}: {fits},"
        f" the shortest estimated step ({milliseconds(best.step_seconds)}) of the meshes that fit;"
        f" {across / 1e9:.2f} GB per rank per step cross nodes;"
        f" exposed traffic on {', '.join(exposed) if exposed else 'no axis'}"
    )


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 1e-3 else f"{seconds * 1e3:.3g} ms"
