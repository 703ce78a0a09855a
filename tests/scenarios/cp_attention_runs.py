"""Context-parallel attention in real processes (gloo, no Lightning): each algorithm against full SDPA, the SDPA
dispatch (every spelling, activation-checkpoint recompute, refusals) and the bytes each collective sends.

Run as ``python tests/scenarios/cp_attention_runs.py --devices 4 --out result.json --scenarios kernels,dispatch``.
One launch of 4 processes covers cp=4 (the world) and cp=2 (two pair subgroups at once); errors are maxima over
every rank. Rank 0 writes ``{scenario: {case: {...}}}`` as JSON.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pure_torch import run_pure_torch_scenarios  # type: ignore[import-not-found]  (before lightning_dist: see there)
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as early_bound_sdpa
from torch.utils.checkpoint import CheckpointError, checkpoint

from lightning_dist.parallel.context_parallel.attention import (
    UlyssesHeadsError,
    context_parallel_attention,
    count_bytes_sent,
)
from lightning_dist.parallel.context_parallel.dispatch import (
    ContextParallelAttention,
    ContextParallelAttentionError,
    gather_sequence,
    local_positions,
    shard_sequence,
)

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 8, 4, 32, 16
# Which layouts each algorithm is tested with (ulysses is meant for contiguous; zigzag is checked too).
LAYOUTS = {"ring": ("zigzag", "contiguous"), "allgather": ("zigzag", "contiguous"), "ulysses": ("contiguous", "zigzag")}


# ---------------------------------------------------------------------------------------------------- helpers
def _max_over_world(values: dict[str, float]) -> dict[str, float]:
    """Every rank's errors, maximised over the world (both cp=2 pairs report through rank 0)."""
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def _max_over_world_nested(result: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``{case: {error: value}}`` maximised over every rank in one all-reduce."""
    flat = _max_over_world({f"{case}|{key}": value for case, errors in result.items() for key, value in errors.items()})
    nested: dict[str, dict[str, float]] = {}
    for composite, value in flat.items():
        case, key = composite.split("|")
        nested.setdefault(case, {})[key] = value
    return nested


def _inputs(dtype: torch.dtype, kv_heads: int, seed: int) -> list[torch.Tensor]:
    """q, k, v and the output weight w, identical on every rank, rounded to ``dtype`` and held in fp64."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, HEADS, SEQ, HEAD_DIM), (BATCH, kv_heads, SEQ, HEAD_DIM), (BATCH, kv_heads, SEQ, HEAD_DIM)]
    tensors = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).double() for s in shapes]
    return [*tensors, torch.randn(shapes[0], generator=gen, dtype=torch.float64)]


def _attention_grads(fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    (out.double() * w).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    return {name: (g.double() - t).abs().max().item() for name, g, t in zip(("out", "dq", "dk", "dv"), got, want)}


def _case(group: Any, algorithm: str, layout: str, causal: bool, kv_heads: int, dtype: torch.dtype) -> dict:
    """This rank's largest errors (output and gradients of its shard) against fp64 SDPA on the whole sequence."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, w = _inputs(dtype, kv_heads, seed=zlib.crc32(f"{algorithm}{layout}{causal}{kv_heads}{dtype}".encode()))
    gqa = kv_heads != HEADS

    def full(q_: Any, k_: Any, v_: Any) -> Any:
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=gqa)

    def cp_attention(q_: Any, k_: Any, v_: Any) -> Any:
        return context_parallel_attention(
            q_, k_, v_, group, algorithm=algorithm, layout=layout, is_causal=causal, enable_gqa=gqa
        )

    def local(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, cp, rank, layout, dim=2)

    reference = [local(t) for t in _attention_grads(full, q, k, v, w)]
    got = _attention_grads(cp_attention, *(local(t).to(dtype) for t in (q, k, v)), local(w))
    errors = _errors(got, reference)
    if dtype != torch.float64:  # what one process reaches in this dtype, for scale
        plain = _attention_grads(full, *(t.to(dtype) for t in (q, k, v)), w)
        errors.update({f"plain_{name}": err for name, err in _errors([local(t) for t in plain], reference).items()})
    return errors


def _pair_group(rank: int, pairs: list[Any]) -> Any:
    return pairs[rank // 2]


# ---------------------------------------------------------------------------------------------------- scenarios
def kernels(rank: int, pairs: list[Any]) -> dict[str, Any]:
    """Every algorithm × layout × causal × (MHA, GQA) in fp64; a subset in fp32 and bf16; at cp=2 and cp=4."""
    cases = []
    for algorithm, layouts in LAYOUTS.items():
        for layout in layouts:
            for causal in (False, True):
                for kv_heads in (HEADS, KV_HEADS):
                    cases.append((algorithm, layout, causal, kv_heads, torch.float64))
        for dtype in (torch.float32, torch.bfloat16):
            cases.append((algorithm, layouts[0], True, KV_HEADS, dtype))
            cases.append((algorithm, layouts[0], False, HEADS, dtype))
    result = {}
    for cp, group in ((4, None), (2, _pair_group(rank, pairs))):
        for algorithm, layout, causal, kv_heads, dtype in cases:
            name = (
                f"cp{cp}-{algorithm}-{layout}-{'causal' if causal else 'full'}-{'gqa' if kv_heads < HEADS else 'mha'}"
            )
            name += f"-{str(dtype).removeprefix('torch.')}"
            result[name] = _case(group, algorithm, layout, causal, kv_heads, dtype)
    return _max_over_world_nested(result)


class _Attention(nn.Module):
    """Causal GQA self-attention whose SDPA call is spelled in one of several ways."""

    def __init__(self, spelling: str, dim: int = 32, heads: int = 8, kv_heads: int = 4) -> None:
        super().__init__()
        self.spelling, self.heads, self.kv_heads, self.head_dim = spelling, heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)
        self.stored_sdpa = F.scaled_dot_product_attention  # a reference kept before any patch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.spelling == "F":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.4, enable_gqa=True)
        elif self.spelling == "early_bound":
            y = early_bound_sdpa(q, k, v, None, 0.0, True, enable_gqa=True)
        elif self.spelling == "torch_C":
            y = torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif self.spelling == "explicit_causal_mask":  # as Hugging Face models build it, from local shapes
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            y = self.stored_sdpa(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class _Net(nn.Module):
    def __init__(self, spelling: str, activation_checkpointing: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Attention(spelling) for _ in range(2))
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing else block(x))
        return x


def _net_grads(net: _Net, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    net.zero_grad()
    (net(x) * w).sum().backward()
    return [p.grad.clone() for p in net.parameters()]


# Every spelling with and without activation checkpointing for the ring; the other algorithms with checkpointing.
_DISPATCH_CASES = [
    ("ring", "zigzag", "explicit_causal_mask", True),
    *(
        ("ring", "zigzag", spelling, ac)
        for spelling in ("F", "early_bound", "torch_C", "stored")
        for ac in (False, True)
    ),
    *(
        (algorithm, layout, spelling, True)
        for algorithm, layout in (("allgather", "zigzag"), ("ulysses", "contiguous"))
        for spelling in ("F", "early_bound", "torch_C")
    ),
]


def dispatch(rank: int, pairs: list[Any]) -> dict[str, Any]:
    """Gradients of a 2-block model (CP, summed over the group) equal one process's, for each SDPA spelling, with
    and without activation checkpointing; a stored SDPA reference under checkpointing fails loudly."""
    result: dict[str, Any] = {}
    x = torch.randn(2, SEQ, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(2, SEQ, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    errors: dict[str, dict[str, float]] = {}
    for cp, group in ((4, None), (2, _pair_group(rank, pairs))):
        for algorithm, layout, spelling, ac in _DISPATCH_CASES:
            torch.manual_seed(0)
            net = _Net(spelling, ac).double()
            want = _net_grads(net, x, w)
            x_local, w_local = (shard_sequence(t, cp, dist.get_rank(group), layout) for t in (x, w))
            name = f"cp{cp}-{algorithm}-{spelling}-{'ac' if ac else 'noac'}"
            try:
                masks = "causal" if spelling == "explicit_causal_mask" else "refuse"
                with ContextParallelAttention(group, algorithm, layout, explicit_masks=masks):
                    got = _net_grads(net, x_local, w_local)
            except CheckpointError as error:
                result[name] = {"error": f"CheckpointError: {str(error)[:120]}"}
                continue
            for grad in got:
                dist.all_reduce(grad, group=group)
            errors[name] = {"grad": max((g - t).abs().max().item() for g, t in zip(got, want))}
    result.update(_max_over_world_nested(errors))
    result["gathered_positions"] = [
        gather_sequence(local_positions(SEQ, cp, dist.get_rank(group), layout)[None], group, layout).tolist()
        == [list(range(SEQ))]
        for cp, group in ((4, None), (2, _pair_group(rank, pairs)))
        for layout in ("zigzag", "contiguous")
    ]
    result["restored"] = (
        F.scaled_dot_product_attention is early_bound_sdpa
        and torch._C._nn.scaled_dot_product_attention is early_bound_sdpa
        and globals()["early_bound_sdpa"] is torch._C._nn.scaled_dot_product_attention
    )
    result["refusals"] = _refusals()
    return result


def _refusals() -> dict[str, str]:
    """The messages of what the dispatch refuses (raised on every rank before any communication)."""
    q = torch.randn(1, 6, 8, 16)
    k = torch.randn(1, 3, 8, 16)
    attempts = {
        "attn_mask": lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool)),
        "dropout": lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1),
        "ulysses_heads": lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=True),
        "gqa_without_enable_gqa": lambda: F.scaled_dot_product_attention(q, k, k),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            with ContextParallelAttention(None, "ulysses", "contiguous"):
                attempt()
            messages[name] = "no error"
        except (ContextParallelAttentionError, UlyssesHeadsError, ValueError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def comm_bytes(rank: int, pairs: list[Any]) -> dict[str, Any]:
    """Bytes this rank sends per attention layer (forward, backward) for each algorithm, cp=4, GQA."""
    result: dict[str, Any] = {
        "shape": {"batch": BATCH, "seq_len": SEQ, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "cp": 4}
    }
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, _ = _inputs(dtype, KV_HEADS, seed=3)
        local = [shard_sequence(t, 4, rank, "zigzag", dim=2).to(dtype).requires_grad_() for t in (q, k, v)]
        for algorithm in ("ring", "allgather", "ulysses"):
            layout = "contiguous" if algorithm == "ulysses" else "zigzag"
            with count_bytes_sent() as forward:
                out = context_parallel_attention(*local, None, algorithm, layout, is_causal=True, enable_gqa=True)
            with count_bytes_sent() as backward:
                out.sum().backward()
            result[f"{algorithm}-{str(dtype).removeprefix('torch.')}"] = {
                "forward": dict(forward),
                "backward": dict(backward),
            }
    return result


SCENARIOS = {"kernels": kernels, "dispatch": dispatch, "comm_bytes": comm_bytes}


# ---------------------------------------------------------------------------------------------------- launch
def _pairs(rank: int, world: int) -> list[dist.ProcessGroup]:
    """Groups of two ranks, (0, 1), (2, 3), ...: every scenario's second argument."""
    return [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]


if __name__ == "__main__":
    run_pure_torch_scenarios(SCENARIOS, 4, _pairs)
