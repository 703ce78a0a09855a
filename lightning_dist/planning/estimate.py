"""Per-rank memory and per-step communication of one mesh, from :class:`~.model_facts.ModelFacts`.

Placement follows the strategies: pipeline stages split the blocks evenly (embeddings on the first stage, final norm
and head on the last; the worse stage is reported), tensor parallelism shards what its automatic plan shards, and
FSDP2 shards every parameter of a stage over ``dp_shard × cp``. Under expert parallelism (``ep``) each ep rank holds
``1/ep`` of every MoE layer's experts, which FSDP2 shards again over the ``dp_shard × cp / ep`` ranks ep leaves
(``ep_fsdp``: gathered and reduced there only) and replicates over tp and dp_replicate; tokens travel to them by
all-to-all. Activations are the meta-forward counts scaled to
the local micro-batch and sequence (``seq / cp``), the inner part divided by ``tp``; a pipeline stage keeps the
activations of the micro-batches in flight (1F1B: ``pp``, GPipe: all of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_dist.parallel.mesh import ParallelDims
from lightning_dist.planning.model_facts import ActivationFacts, ModelFacts

GIB = 1024**3

PARAM_BYTES = {"64-true": 8, "32-true": 4, "bf16-mixed": 4, "16-mixed": 4, "bf16-true": 2, "16-true": 2}
COMPUTE_BYTES = {"64-true": 8, "32-true": 4, "bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2, "16-true": 2}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes, and how."""

    seq_len: int
    micro_batch: int  # samples per rank per micro-step
    global_batch: int  # samples per optimizer step, over all data-parallel ranks
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    #: The strategies' option: ``True`` every block, an int k every k-th, ``"selective"`` the blocks' inputs and their
    #: matmul and attention outputs; a list of classes is counted as none (an upper bound).
    activation_checkpointing: bool | int | str | tuple = False
    schedule: str = "1f1b"

    @property
    def checkpointed_fraction(self) -> float:
        """The share of blocks whose activations the planner counts as recomputed (1.0, 1/k or 0.0)."""
        ac = self.activation_checkpointing
        if ac is True:
            return 1.0
        return 1.0 / ac if isinstance(ac, int) and not isinstance(ac, bool) and ac >= 1 else 0.0


@dataclass(frozen=True)
class Hardware:
    """Per-device memory, link bandwidths and latencies (defaults: an 80 GB GPU, NVLink inside a node, 400 Gb/s
    across).

    The latencies are NCCL's own cost model for small messages (ring algorithm, LL protocol, which NCCL picks when
    latency dominates; ``baseLat`` and ``hwLat`` in NCCL's ``src/graph/tuning.cc``): 6.6 µs per collective or send,
    plus 0.6 µs per ring step over NVLink and 2.7 µs per step over the network. They are NCCL's lowest, so they never
    overstate what small meshes lose to latency; for large messages bandwidth dominates either way.
    ``pipeline_action_s`` is the host time a pipeline schedule spends per action (one micro-batch's forward or
    backward on one stage) outside the kernels: Python dispatch and P2P bookkeeping in
    ``torch.distributed.pipelining``. It is an order-of-magnitude figure, not a measurement; it matters only where
    the compute per action is tiny.
    """

    devices_per_node: int
    memory_bytes: float = 80 * GIB
    intra_node_bytes_per_s: float = 300e9
    inter_node_bytes_per_s: float = 50e9
    op_latency_s: float = 6.6e-6
    intra_node_step_latency_s: float = 0.6e-6
    inter_node_step_latency_s: float = 2.7e-6
    pipeline_action_s: float = 20e-6


@dataclass
class Estimate:
    """Per-rank memory (bytes) and per-step communication (bytes sent per rank, by axis and inside/across nodes)."""

    mesh: ParallelDims
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    comm: dict[str, tuple[float, float]] = field(default_factory=dict)  # axis -> (inside a node, across nodes)
    # axis -> (collectives and sends, their ring steps inside a node, across nodes) per rank per step
    messages: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def memory(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    def axis_seconds(self, hardware: Hardware) -> dict[str, float]:
        """Seconds each axis communicates per step: its bytes over the links' bandwidth plus its messages' latency."""
        seconds = {}
        for axis, (inside, across) in self.comm.items():
            ops, steps_inside, steps_across = self.messages.get(axis, (0.0, 0.0, 0.0))
            seconds[axis] = (
                inside / hardware.intra_node_bytes_per_s
                + across / hardware.inter_node_bytes_per_s
                + ops * hardware.op_latency_s
                + steps_inside * hardware.intra_node_step_latency_s
                + steps_across * hardware.inter_node_step_latency_s
            )
        return seconds

    def comm_seconds(self, hardware: Hardware) -> float:
        return sum(self.axis_seconds(hardware).values())


def stage_params(facts: ModelFacts, mesh: ParallelDims) -> tuple[float, float]:
    """Parameters (elements) on one rank of the fuller pipeline stage that FSDP shards, and those of one block
    (what one FSDP unit gathers); under ep the experts are not among them (:func:`stage_expert_params`)."""
    blocks = math.ceil(facts.blocks / mesh.pp)
    experts = facts.block_expert_params if mesh.ep > 1 else 0
    block = facts.block_tp_params / mesh.tp + (facts.block_params - facts.block_tp_params - experts)
    outer_tp_share = facts.outer_tp_params / max(1, facts.first_stage_params + facts.last_stage_params)
    outer = facts.first_stage_params + facts.last_stage_params
    if mesh.pp > 1:
        outer = max(facts.first_stage_params, facts.last_stage_params)
    outer *= (1 - outer_tp_share) + outer_tp_share / mesh.tp
    return blocks * block + outer, block


def stage_expert_params(facts: ModelFacts, mesh: ParallelDims) -> float:
    """Expert parameters (elements) one ep rank of the fuller stage has under ep (``1/ep`` of its blocks'), before
    FSDP2 shards them over ep_fsdp; 0 without ep (FSDP shards the experts with the rest of the block)."""
    if mesh.ep == 1:
        return 0.0
    return math.ceil(facts.blocks / mesh.pp) * facts.block_expert_params / mesh.ep


def _ep_fsdp(mesh: ParallelDims) -> int:
    """The ranks FSDP2 shards each ep rank's experts over (``dp_shard × cp / ep``; 1 without ep)."""
    return mesh.dp_shard * mesh.cp // mesh.ep


def estimate(
    facts: ModelFacts, activations: ActivationFacts | None, mesh: ParallelDims, workload: Workload, hardware: Hardware
) -> Estimate:
    """Memory and communication of ``mesh`` (``activations``: counted at ``workload.micro_batch`` and
    ``seq_len / mesh.cp``; ``None`` leaves activations out)."""
    est = Estimate(mesh)
    per_rank, block = stage_params(facts, mesh)
    fsdp = mesh.dp_shard * mesh.cp
    param_bytes = PARAM_BYTES[workload.precision]
    compute_bytes = COMPUTE_BYTES[workload.precision]
    experts = stage_expert_params(facts, mesh)
    est.params = (per_rank / fsdp + experts / _ep_fsdp(mesh)) * param_bytes
    est.grads = est.params
    est.optimizer = est.params * OPTIMIZER_STATES[workload.optimizer]
    if fsdp > 1 and mesh.pp > 1:
        # under a pipeline FSDP2 keeps every unit of the stage gathered through the step (reshard_after_forward is
        # off: one all-gather, not one per micro-batch) and accumulates the unsharded gradients in the reduce dtype
        # until the last micro-batch's backward reduce-scatters them
        est.buffers = (per_rank + experts) * (compute_bytes + param_bytes)
    elif fsdp > 1:  # one unit gathered, the next prefetched, and the gradient unit being reduced
        est.buffers = block * (2 * compute_bytes + 4)
    if _ep_fsdp(mesh) > 1 and mesh.pp == 1:  # and one block's experts, gathered over ep_fsdp
        est.buffers += facts.block_expert_params / mesh.ep * (2 * compute_bytes + 4)
    microbatches = max(1, workload.global_batch // (mesh.batch * workload.micro_batch))
    if activations is not None:
        saved, held = _activation_bytes(facts, activations, mesh, workload, microbatches)
        est.activations, est.buffers = saved, est.buffers + held
    est.comm = _communication(facts, mesh, workload, hardware, per_rank, experts, microbatches)
    est.messages = _messages(facts, mesh, hardware, microbatches)
    return est


def _activation_bytes(
    facts: ModelFacts, act: ActivationFacts, mesh: ParallelDims, workload: Workload, microbatches: int
) -> tuple[float, float]:
    """The fullest pipeline stage's saved activations, and the buffers it holds beside them. Stage ``s`` of 1F1B keeps
    the activations of ``pp − s`` micro-batches in flight (GPipe: all of them), the first the embeddings' too, the last
    the head's and the loss's. Beside them: the loss's backward holds two more logits-sized gradients at once (on the
    last stage), and every stage holds torch's receive buffers, made at setup for every micro-batch: the activations
    it receives (all but the first stage) and their gradients (all but the last), each one ``[micro_batch, seq/cp,
    hidden]`` tensor in the compute dtype."""
    blocks = math.ceil(facts.blocks / mesh.pp)
    per_block = act.per_block_residual + act.per_block_inner / mesh.tp

    def stage(in_flight: int, outside: float) -> float:
        checkpointed = int(blocks * workload.checkpointed_fraction)
        if workload.activation_checkpointing == "selective":  # block inputs and the matmul/attention outputs kept;
            selective = act.selective_residual + act.selective_inner / mesh.tp  # the rest of one block recomputed
            kept = blocks * (act.block_input + selective) * in_flight + per_block - selective
        elif checkpointed:  # their inputs kept; one block recomputed at a time in backward
            kept = (checkpointed * act.block_input + (blocks - checkpointed) * per_block) * in_flight + per_block
        else:
            kept = blocks * per_block * in_flight
        return kept + outside * in_flight

    if mesh.pp == 1:
        return stage(1, act.outside_blocks), act.loss_backward
    fullest = (0.0, 0.0)
    for s in range(mesh.pp):
        in_flight = microbatches if workload.schedule == "gpipe" else min(mesh.pp - s, microbatches)
        first, last = s == 0, s == mesh.pp - 1
        outside = (act.before_blocks if first else 0.0) + (act.after_blocks if last else 0.0)
        received = microbatches * act.block_input * ((not first) + (not last))
        this = (stage(in_flight, outside), received + (act.loss_backward if last else 0.0))
        fullest = max(fullest, this, key=sum)
    return fullest


def _communication(
    facts: ModelFacts,
    mesh: ParallelDims,
    workload: Workload,
    hardware: Hardware,
    per_rank: float,
    experts: float,
    microbatches: int,
) -> dict[str, tuple[float, float]]:
    """Bytes one rank sends per optimizer step, by axis: ring collectives send ``(n − 1)/n`` of the buffer; an
    all-to-all sends ``(n − 1)/n`` of its rows (the rest stay on the rank)."""
    compute = COMPUTE_BYTES[workload.precision]
    reduce = 8 if workload.precision == "64-true" else 4
    tokens = workload.micro_batch * workload.seq_len // mesh.cp
    activation = tokens * facts.hidden * compute  # one [micro_batch, seq/cp, hidden] tensor
    blocks = math.ceil(facts.blocks / mesh.pp)
    fsdp = mesh.dp_shard * mesh.cp
    sent: dict[str, float] = {}
    if fsdp > 1:  # all-gather in forward and backward, reduce-scatter of the gradients, once per micro-batch
        ring = (fsdp - 1) / fsdp
        sent["dp_shard"] = microbatches * per_rank * ring * (2 * compute + reduce)
    if mesh.dp_replicate > 1:  # all-reduce of the shard's gradients once per step
        ring = (mesh.dp_replicate - 1) / mesh.dp_replicate
        sent["dp_replicate"] = 2 * ring * per_rank / fsdp * reduce
    if mesh.tp > 1:  # two all-reduces per block forward and two backward, of one activation each
        ring = (mesh.tp - 1) / mesh.tp
        sent["tp"] = microbatches * blocks * 4 * 2 * ring * activation
    if mesh.cp > 1 and facts.kv_heads and facts.heads:  # ring: K/V around the ring forward, K/V + dK/dV backward
        kv = activation * facts.kv_heads / facts.heads * 2
        sent["cp"] = microbatches * blocks * (mesh.cp - 1) * kv * (2 + reduce / compute)
    if mesh.ep > 1:  # per MoE block: dispatch and combine forward, their gradients backward, top_k rows per token
        sent["ep"] = microbatches * blocks * 4 * facts.top_k * activation * (mesh.ep - 1) / mesh.ep
        if (shards := _ep_fsdp(mesh)) > 1:  # FSDP2 over ep_fsdp: the experts gathered twice and reduced
            sent["ep_fsdp"] = microbatches * experts * (shards - 1) / shards * (2 * compute + reduce)
            if mesh.dp_replicate > 1:  # HSDP: their shards' gradients all-reduced over dp_replicate once per step
                ring = (mesh.dp_replicate - 1) / mesh.dp_replicate
                sent["ep_replicas"] = 2 * ring * experts / shards * reduce
        elif mesh.dp_replicate > 1:  # the experts' gradients all-reduced over the ranks holding the same experts
            ring = (mesh.dp_replicate - 1) / mesh.dp_replicate
            sent["ep_replicas"] = 2 * ring * experts * reduce
    if mesh.pp > 1:  # activations forward, their gradients backward, at one stage boundary
        sent["pp"] = microbatches * 2 * activation
    return {axis: _split_by_node(axis, mesh, hardware, b) for axis, b in sent.items()}


def _messages(
    facts: ModelFacts, mesh: ParallelDims, hardware: Hardware, microbatches: int
) -> dict[str, tuple[float, float, float]]:
    """Collectives and sends per step on one rank's critical path, by axis, as ``(operations, ring steps inside a
    node, across nodes)``, counted as :func:`_communication` counts their bytes. FSDP2 gathers and reduces one unit
    per block and one for the modules outside the blocks; a ring all-gather or reduce-scatter over ``n`` ranks takes
    ``n − 1`` steps, an all-reduce ``2(n − 1)``, a send one. The pipeline's sends on the critical path: one per
    forward and one per backward of each of the ``m + pp − 1`` slots of the schedule (the bubble's slots included)."""
    blocks = math.ceil(facts.blocks / mesh.pp)
    fsdp = mesh.dp_shard * mesh.cp
    found: dict[str, tuple[float, float]] = {}  # axis -> (operations, ring steps)
    if fsdp > 1:  # all-gather forward, all-gather backward, reduce-scatter, per unit and micro-batch
        found["dp_shard"] = (3 * (blocks + 1) * microbatches, 3 * (blocks + 1) * microbatches * (fsdp - 1))
    if mesh.dp_replicate > 1:  # one all-reduce per unit per step
        found["dp_replicate"] = (blocks + 1, (blocks + 1) * 2 * (mesh.dp_replicate - 1))
    if mesh.tp > 1:  # four all-reduces per block
        ops = 4 * blocks * microbatches
        found["tp"] = (ops, ops * 2 * (mesh.tp - 1))
    if mesh.cp > 1 and facts.kv_heads and facts.heads:  # one send per ring step, forward and backward, per block
        ops = 2 * blocks * microbatches * (mesh.cp - 1)
        found["cp"] = (ops, ops)
    if mesh.ep > 1:  # per MoE block and micro-batch: dispatch and combine, forward and backward, each with the
        ops = 4 * blocks * microbatches  # row counts exchanged first (a second, tiny all-to-all)
        found["ep"] = (2 * ops, 2 * ops * (mesh.ep - 1))
        if (shards := _ep_fsdp(mesh)) > 1:  # all-gather forward and backward, reduce-scatter, per MoE block
            found["ep_fsdp"] = (3 * blocks * microbatches, 3 * blocks * microbatches * (shards - 1))
        if mesh.dp_replicate > 1:
            found["ep_replicas"] = (1, 2 * (mesh.dp_replicate - 1))
    if mesh.pp > 1:
        ops = 2 * (microbatches + mesh.pp - 1)
        found["pp"] = (ops, ops)
    return {axis: (ops, *_split_by_node(axis, mesh, hardware, steps)) for axis, (ops, steps) in found.items()}


def _split_by_node(axis: str, mesh: ParallelDims, hardware: Hardware, sent: float) -> tuple[float, float]:
    """Inside/across nodes. Ranks are numbered with tp innermost, so the members of an axis's groups are ``stride``
    apart (the product of the axes inside it); ``k`` members share a node, and a ring crosses nodes at 1 hop in k.
    The FSDP group (``dp_shard``) is ``dp_shard × cp``."""
    sizes = {"dp_shard": mesh.dp_shard * mesh.cp, "ep_fsdp": _ep_fsdp(mesh), "ep_replicas": mesh.dp_replicate}
    size = sizes.get(axis) or getattr(mesh, axis)
    inside_axes = {"pp": ("dp_replicate", "dp_shard", "cp", "tp"), "dp_replicate": ("dp_shard", "cp", "tp")}
    inside_axes.update({"dp_shard": ("tp",), "cp": ("tp",), "tp": ()})
    # ep takes consecutive ranks of the dp_shard × cp group; ep_fsdp's are ep of them apart; the experts' HSDP
    # replicas are dp_replicate's
    inside_axes.update({"ep": ("tp",), "ep_fsdp": ("tp", "ep"), "ep_replicas": ("dp_shard", "cp", "tp")})
    stride = math.prod(getattr(mesh, a) for a in inside_axes[axis])
    k = min(size, max(1, hardware.devices_per_node // stride))
    if k >= size:
        return sent, 0.0
    return sent * (1 - 1 / k), sent / k
