"""What the mesh planner needs to know about a model, read off a copy built on the meta device (no memory).

Parameter counts come from the parameters themselves, split by where they live: inside the repeated blocks or
outside (embeddings on the first pipeline stage, the head and final norm on the last), and by whether the automatic
tensor-parallel plan shards them. Activations come from one forward on meta tensors with autograd's saved-tensor
hooks: every distinct storage autograd keeps for backward, attributed to the block that was running, and split into
the residual stream (``[..., hidden]``: every tp rank keeps all of it unless sequence parallel splits it) and the
inner tensors (heads, the MLP's width: split by tp).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_dist.compat import TorchDispatchMode, storage_identity
from lightning_dist.parallel.activation_checkpointing import selective_saved_ops
from lightning_dist.parallel.expert_parallel.structure import find_experts
from lightning_dist.parallel.model_structure import recognize


@dataclass(frozen=True)
class ActivationFacts:
    """Bytes autograd saves in one forward at a given micro-batch and (local) sequence length."""

    per_block_residual: float  # largest block: tensors of shape [..., hidden]
    per_block_inner: float  # largest block: the rest (split by tp)
    block_input: float  # what activation checkpointing keeps per block: its input
    before_blocks: float  # embeddings: on the first pipeline stage
    after_blocks: float  # final norm, head and the loss's log-probabilities: on the last pipeline stage
    loss_backward: float = 0.0  # while the loss's backward runs: the gradients of the log-probabilities and logits
    #: Largest block under ``activation_checkpointing="selective"``: what it keeps of the saved tensors, the outputs
    #: of its matmuls and attention (residual-shaped, and the rest split by tp).
    selective_residual: float = 0.0
    selective_inner: float = 0.0

    @property
    def outside_blocks(self) -> float:
        return self.before_blocks + self.after_blocks


@dataclass(frozen=True)
class ModelFacts:
    """Parameter counts and shapes of a model that decide how it parallelizes."""

    blocks: int
    block_params: int  # the largest block
    block_tp_params: int  # of which tensor parallelism shards
    first_stage_params: int  # outside the blocks, on the first stage (embeddings)
    last_stage_params: int  # outside the blocks, on the last stage (final norm, head)
    outer_tp_params: int  # outside the blocks, sharded by tp (vocabulary-parallel embedding and head)
    hidden: int
    heads: int | None
    kv_heads: int | None
    vocab: int | None
    block_expert_params: int = 0  # of the largest block's parameters, its routed experts' (all of them)
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model)
    top_k: int = 0  # experts each token is routed to

    @property
    def total_params(self) -> int:
        return self.blocks * self.block_params + self.first_stage_params + self.last_stage_params

    @property
    def active_params(self) -> float:
        """The parameters one token's matmuls use: routed experts count ``top_k / num_experts`` of theirs."""
        if not self.num_experts:
            return float(self.total_params)
        unused = self.blocks * self.block_expert_params * (1 - self.top_k / self.num_experts)
        return self.total_params - unused


def model_facts(model: nn.Module) -> ModelFacts:
    """Counts of ``model`` (built on any device; the meta device costs nothing)."""
    from lightning_dist.parallel.tensor_parallel import resolve_plan

    structure = recognize(model)
    if not structure.blocks:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (a ModuleList of identical layers): the planner splits"
            " models by their blocks."
        )
    modules = dict(model.named_modules())
    sharded = {id(p) for name in _plan_modules(model, resolve_plan) for p in modules[name].parameters(recurse=True)}
    in_blocks: set[int] = set()
    block_sizes, block_tp = [], []
    for name in structure.blocks:
        params = list(modules[name].parameters())
        in_blocks.update(id(p) for p in params)
        block_sizes.append(sum(p.numel() for p in params))
        block_tp.append(sum(p.numel() for p in params if id(p) in sharded))
    head = structure.output_head
    last_names = {n for n in (head, *structure.norms) if n and not any(n.startswith(f"{b}.") for b in structure.blocks)}
    last_ids = {id(p) for n in last_names for p in modules[n].parameters()}
    first = last = outer_tp = 0
    seen: set[int] = set()
    for p in model.parameters():  # tied weights once, on the first stage
        if id(p) in in_blocks or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in last_ids:
            last += p.numel()
        else:
            first += p.numel()
        outer_tp += p.numel() if id(p) in sharded else 0
    attention = next(iter(structure.attention.values()), None)
    embedding = modules.get(structure.token_embedding or "")
    vocab = getattr(embedding, "num_embeddings", None)
    hidden = getattr(embedding, "embedding_dim", None) or _hidden_of(modules[structure.blocks[0]])
    experts = _experts_by_block(model, structure.blocks)
    return ModelFacts(
        blocks=len(structure.blocks),
        block_params=max(block_sizes),
        block_tp_params=max(block_tp),
        first_stage_params=first,
        last_stage_params=last,
        outer_tp_params=outer_tp,
        hidden=hidden,
        heads=attention.num_heads if attention else None,
        kv_heads=(attention.num_kv_heads or attention.num_heads) if attention else None,
        vocab=vocab,
        block_expert_params=max((params for params, _, _ in experts.values()), default=0),
        num_experts=max((e for _, e, _ in experts.values()), default=0),
        top_k=max((k for _, _, k in experts.values()), default=0),
    )


def _experts_by_block(model: nn.Module, blocks: list[str]) -> dict[str, tuple[int, int, int]]:
    """Block name → (its routed experts' parameters, experts per layer, top-k), for the blocks holding any."""
    found: dict[str, tuple[int, int, int]] = {}
    for layer in find_experts(model):
        block = next((b for b in blocks if layer.name.startswith(f"{b}.")), None)
        if block is not None:
            params, experts, top_k = found.get(block, (0, 0, 0))
            found[block] = (params + layer.params, max(experts, layer.experts), max(top_k, layer.top_k or 0))
    return found


def activation_facts(model: nn.Module, micro_batch: int, seq_len: int) -> ActivationFacts:
    """Saved-activation bytes of one training forward of ``model`` on token ids ``[micro_batch, seq_len]``.

    The model is run as it is (put it on the meta device first: nothing is allocated) and called with the token ids
    as its only argument, as causal LMs are; the loss's own saved tensor (log-probabilities, fp32) is added, and the
    two gradients of the logits' size its backward holds at once (``loss_backward``).
    """
    structure = recognize(model)
    modules = dict(model.named_modules())
    hidden = model_facts(model).hidden
    counter = _SavedBytes(hidden, micro_batch, seq_len)
    with (
        counter.attributing(model, [modules[name] for name in structure.blocks]),
        _FlashAttentionSaves(counter.kept_by_selective),
        _SelectiveOutputs(counter.kept_by_selective),
    ):
        device = next(model.parameters()).device
        output = model(torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device))
    logits = getattr(output, "logits", output)
    loss_bytes = logits.numel() * 4 if isinstance(logits, torch.Tensor) else 0  # fp32, as the loss computes them
    per_block = max(counter.blocks, key=lambda b: b[0] + b[1], default=(0.0, 0.0, 0.0, 0.0))
    selective = max(counter.blocks, key=lambda b: b[2] + b[3], default=(0.0, 0.0, 0.0, 0.0))
    element = next(model.parameters()).element_size()
    return ActivationFacts(
        per_block_residual=per_block[0],
        per_block_inner=per_block[1],
        block_input=micro_batch * seq_len * hidden * element,
        before_blocks=counter.before,
        after_blocks=counter.after + loss_bytes,
        loss_backward=2 * loss_bytes,
        selective_residual=selective[2],
        selective_inner=selective[3],
    )


def _plan_modules(model: nn.Module, resolve_plan) -> list[str]:
    try:
        return list(resolve_plan(model).styles)
    except Exception:  # noqa: BLE001 (a model the automatic plan refuses: nothing is tp-sharded)
        return []


def _hidden_of(block: nn.Module) -> int:
    return max((m.normalized_shape[-1] for m in block.modules() if isinstance(m, nn.LayerNorm)), default=0)


class _FlashAttention(torch.autograd.Function):
    """Stands in for SDPA in the counting forward: saves what a flash kernel saves (q, k, v, the output and one fp32
    log-sum-exp per query), not the ``S × S`` scores the math kernel (the only one on the meta device) would keep.
    The output takes the query's memory layout, as CPU's flash kernel gives it (observed, torch 2.13): for a query
    that is a transposed ``[batch, seq, heads, dim]`` projection, the usual ``transpose(1, 2).reshape(...)`` before
    the output projection is then a view, not a copy (a contiguous ``[batch, heads, seq, dim]`` output counted one
    more ``[batch, seq, hidden]`` tensor per block than the real run keeps)."""

    #: Where the outputs selective checkpointing keeps are noted (the attention output and its log-sum-exp).
    kept: set[int] | None = None

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        same_dim = v.shape[-1] == q.shape[-1]
        out = torch.empty_like(q) if same_dim else q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        if _FlashAttention.kept is not None:
            _FlashAttention.kept.update(storage_identity(t) for t in (out, lse))
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:  # never run: the forward is only counted
        return None, None, None


class _FlashAttentionSaves(TorchFunctionMode):
    def __init__(self, kept: set[int]) -> None:
        super().__init__()
        self.kept = kept

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            _FlashAttention.kept = self.kept
            try:
                return _FlashAttention.apply(*args[:3])
            finally:
                _FlashAttention.kept = None
        return func(*args, **(kwargs or {}))


class _SelectiveOutputs(TorchDispatchMode):
    """Notes the storages of the outputs of the ops selective checkpointing keeps (matmuls, attention)."""

    def __init__(self, kept: set[int]) -> None:
        super().__init__()
        self.kept, self.ops = kept, selective_saved_ops()
        self.alive: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in self.ops or (func in self.bias_adds and self._adds_a_bias_to_a_kept_output(args)):
            outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, Tensor)]
            self.kept.update(storage_identity(t) for t in outputs)
            self.alive.extend(t.untyped_storage() for t in outputs)  # no later storage takes a noted identity
        return out

    #: A linear layer's bias added to its matmul's output: one ``addmm`` on some devices, ``mm`` then ``add`` on
    #: others (the CPU, for 3-D inputs); either way the layer's output is what selective checkpointing keeps.
    bias_adds = {torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor}

    def _adds_a_bias_to_a_kept_output(self, args: tuple) -> bool:
        tensors = [a for a in args[:2] if isinstance(a, Tensor)]
        return len(tensors) == 2 and tensors[1].dim() == 1 and storage_identity(tensors[0]) in self.kept


class _SavedBytes:
    """Distinct storages saved for backward, by running block (residual vs inner), and before/after the blocks."""

    def __init__(self, hidden: int, micro_batch: int, seq_len: int) -> None:
        self.hidden = hidden
        self.residual_shapes = {(micro_batch, seq_len, hidden), (seq_len, micro_batch, hidden)}
        self.blocks: list[tuple[float, ...]] = []
        self.before = 0.0  # saved before the first block runs
        self.after = 0.0  # and after a block has run
        self._current: list[float] | None = None  # residual, inner; of those, kept by selective checkpointing
        self.kept_by_selective: set[int] = set()  # storages selective checkpointing keeps (ops' outputs)
        self._seen: set[int] = set()
        self._params: set[int] = set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = storage_identity(t)
        if storage in self._seen or storage in self._params:
            return t
        self._seen.add(storage)
        nbytes = t.untyped_storage().nbytes()
        if self._current is None:
            if self.blocks:
                self.after += nbytes
            else:
                self.before += nbytes
        else:
            inner = tuple(t.shape) not in self.residual_shapes
            self._current[inner] += nbytes
            if storage in self.kept_by_selective:
                self._current[2 + inner] += nbytes
        return t

    @contextmanager
    def attributing(self, model: nn.Module, blocks: list[nn.Module]) -> Iterator[None]:
        self._params = {storage_identity(p) for p in model.parameters()}

        def enter(module: nn.Module, args: object) -> None:
            self._current = [0.0, 0.0, 0.0, 0.0]

        def leave(module: nn.Module, args: object, output: object) -> None:
            self.blocks.append(tuple(self._current))  # type: ignore[arg-type]
            self._current = None

        handles = [h for b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()
