"""Tests for ``lightning_dist.profiling``: communication byte counting and memory accounting.

The distributed checks run once, in a single 4-rank gloo launch (``torch.multiprocessing.spawn``); every rank writes
what it observed to a JSON file and the tests below assert on it. Expected byte counts are written out by hand from
the definitions in ``lightning_dist/profiling/comm_traffic.py`` (n = 4 ranks, 2 ranks per node, so every rank of the world
group has 2 off-node peers).
"""

from __future__ import annotations

import json
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_dist.profiling import (
    CommCounter,
    NodeTopology,
    attach_phase_hooks,
    canonical_op_name,
    cuda_peak_memory_bytes,
    peak_process_memory_bytes,
    state_bytes,
)

WORLD = 4
RANKS_PER_NODE = 2
FP32 = 4


def _mlp(out_features: int = 4) -> nn.Sequential:
    """Linear(8,16) + Linear(16,out): 576 + (16*out + out)*4 bytes of fp32 parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, out_features))


MLP_PARAM_BYTES = (8 * 16 + 16 + 16 * 4 + 4) * FP32  # 848


# ---------------------------------------------------------------------------------------------------------------------
# Fast single-process tests
# ---------------------------------------------------------------------------------------------------------------------


def test_node_topology() -> None:
    topo = NodeTopology(ranks_per_node=2)
    assert [topo.node_of(r) for r in range(5)] == [0, 0, 1, 1, 2]
    assert topo.same_node(2, 3) and not topo.same_node(1, 2)
    single = NodeTopology()
    assert single.node_of(123) == 0 and single.same_node(0, 1000)
    with pytest.raises(ValueError):
        NodeTopology(0)


def test_node_topology_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert NodeTopology.from_env() == NodeTopology(8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert NodeTopology.from_env() == NodeTopology(None)


def test_canonical_op_names() -> None:
    assert canonical_op_name("all_gather_single") == "all_gather_into_tensor"
    assert canonical_op_name("reduce_scatter_single") == "reduce_scatter_tensor"
    assert canonical_op_name("isend") == "send"
    assert canonical_op_name("all_reduce") == "all_reduce"


def test_counter_activation_and_restore() -> None:
    counter = CommCounter()
    assert _get_current_dispatch_mode() is None
    with counter:
        assert counter.active
        with pytest.raises(RuntimeError, match="already active"):
            counter.__enter__()
        with CommCounter() as inner:  # nesting two counters is allowed
            assert inner.active
    assert _get_current_dispatch_mode() is None and not counter.active

    with pytest.raises(ValueError, match="boom"), counter:
        raise ValueError("boom")
    assert _get_current_dispatch_mode() is None and not counter.active

    outer, inner = CommCounter(), CommCounter()
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="out of order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert _get_current_dispatch_mode() is None


def test_counter_phases_and_empty_queries() -> None:
    counter = CommCounter()
    assert counter.current_phase == "unlabeled"
    with counter.phase("forward"):
        assert counter.current_phase == "forward"
        with counter.phase("inner"):
            assert counter.current_phase == "inner"
        assert counter.current_phase == "forward"
    assert counter.current_phase == "unlabeled"
    counter.set_phase("step")
    assert counter.current_phase == "step"
    assert counter.total() == 0 and counter.total("count") == 0 and counter.by_op() == {}
    with pytest.raises(ValueError):
        counter.total("bogus")
    summary = counter.summary()
    json.dumps(summary)
    assert summary["totals"] == {"count": 0, "tensor_bytes": 0, "sent_bytes": 0, "cross_node_bytes": 0}


def test_attach_phase_hooks_labels_and_restores() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = CommCounter()
    handle = attach_phase_hooks(model, counter, optimizers=[opt])
    seen: list[str] = []
    model[0].register_forward_hook(lambda *_: seen.append(counter.current_phase))
    opt.register_step_pre_hook(lambda *_: seen.append(counter.current_phase))
    assert counter.backward_phase == "backward"
    model(torch.randn(2, 8)).sum().backward()
    assert counter.current_phase == "unlabeled"
    opt.step()
    assert seen == ["forward", "optimizer"] and counter.current_phase == "unlabeled"
    handle.remove()
    assert counter.backward_phase is None
    model(torch.randn(2, 8))
    assert seen[-1] == "unlabeled"


def test_counter_is_transparent_without_collectives() -> None:
    model = _mlp()
    x = torch.randn(3, 8)
    expected = model(x)
    with CommCounter() as counter:
        out = model(x)
        out.sum().backward()
    torch.testing.assert_close(out, expected)
    assert counter.records == []


def test_state_bytes_plain_model() -> None:
    model = _mlp()
    model.register_buffer("running", torch.zeros(10))
    model[0].weight2 = model[0].weight  # a tied alias is not a second storage
    assert state_bytes(model) == {
        "parameters": MLP_PARAM_BYTES,
        "buffers": 40,
        "gradients": 0,
        "optimizer_state": 0,
        "total": MLP_PARAM_BYTES + 40,
    }
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    got = state_bytes(model, [opt])
    # Adam: exp_avg + exp_avg_sq per parameter, plus a 0-dim fp32 `step` per parameter (4 parameters).
    assert got["gradients"] == MLP_PARAM_BYTES
    assert got["optimizer_state"] == 2 * MLP_PARAM_BYTES + 4 * FP32
    assert got["total"] == sum(v for k, v in got.items() if k != "total")


def test_peak_memory_helpers() -> None:
    peak = peak_process_memory_bytes()
    assert peak is not None and peak > 10 * 2**20  # torch alone needs more than 10 MiB
    if torch.cuda.is_available():
        stats = cuda_peak_memory_bytes()
        assert stats is not None and stats["max_allocated"] >= stats["allocated"]
    else:
        assert cuda_peak_memory_bytes() is None


# ---------------------------------------------------------------------------------------------------------------------
# Multi-process worker (runs in each spawned rank)
# ---------------------------------------------------------------------------------------------------------------------


def _records(counter: CommCounter) -> list[dict[str, Any]]:
    return [r.to_dict() for r in counter.records]


def _c10d_collectives(rank: int) -> dict[str, Any]:
    """One record per known c10d collective on the world group, with NodeTopology(2)."""
    out: dict[str, Any] = {}
    topo = NodeTopology(RANKS_PER_NODE)

    def run(name: str, fn: Any) -> None:
        with CommCounter(topo) as counter:
            fn()
        out[name] = _records(counter)

    run("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(6 * WORLD), torch.ones(6)))
    run("all_gather_single", lambda: dist.all_gather_single(torch.empty(6 * WORLD), torch.ones(6)))
    run(
        "all_gather_bf16",
        lambda: dist.all_gather(
            [torch.empty(4, dtype=torch.bfloat16) for _ in range(WORLD)], torch.ones(4, dtype=torch.bfloat16)
        ),
    )
    run("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * WORLD)))
    run(
        "reduce_scatter_uneven",  # chunk j (j+1 floats) goes to rank j
        lambda: dist.reduce_scatter(torch.empty(rank + 1), [torch.ones(j + 1) for j in range(WORLD)]),
    )
    run("all_reduce_async", lambda: dist.all_reduce(torch.ones(10), async_op=True).wait())
    run("all_reduce_bf16", lambda: dist.all_reduce(torch.ones(10, dtype=torch.bfloat16)))
    run("all_reduce_uint8", lambda: dist.all_reduce(torch.ones(7, dtype=torch.uint8)))
    run("broadcast", lambda: dist.broadcast(torch.ones(4), src=1))
    splits = [rank + j + 1 for j in range(WORLD)]  # symmetric, so output splits equal input splits
    run(
        "all_to_all_single_uneven",
        lambda: dist.all_to_all_single(
            torch.empty(sum(splits), 3), torch.ones(sum(splits), 3), output_split_sizes=splits, input_split_sizes=splits
        ),
    )
    run("all_to_all", lambda: dist.all_to_all([torch.empty(3) for _ in range(WORLD)], [torch.ones(3)] * WORLD))

    def send_recv() -> None:  # 0 -> 2 (off-node), 1 -> 0 (same node)
        buf = torch.ones(5)
        if rank == 0:
            dist.send(buf, dst=2)
            dist.recv(buf, src=1)
        elif rank == 1:
            dist.send(buf, dst=0)
        elif rank == 2:
            dist.recv(buf, src=0)

    run("send_recv", send_recv)

    def ring() -> None:
        ops = [
            dist.P2POp(dist.isend, torch.ones(2), (rank + 1) % WORLD),
            dist.P2POp(dist.irecv, torch.empty(2), (rank - 1) % WORLD),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    run("batch_isend_irecv", ring)
    return out


def _subgroups(rank: int) -> dict[str, Any]:
    topo = NodeTopology(RANKS_PER_NODE)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    with CommCounter(topo) as counter:
        dist.all_reduce(torch.ones(4), group=pairs[rank // 2])
        dist.all_reduce(torch.ones(4), group=strided[rank % 2])
    return {
        "records": _records(counter),
        "summary": counter.summary(),
        "sent_cross_node_groups": counter.total("sent_bytes", cross_node=True),
        "sent_node_local_groups": counter.total("sent_bytes", cross_node=False),
        "by_op": counter.by_op("cross_node_bytes"),
    }


def _functional_and_dtensor(rank: int) -> dict[str, Any]:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    splits = [rank + j + 1 for j in range(WORLD)]
    a = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    out: dict[str, Any] = {}
    with CommCounter(NodeTopology(RANKS_PER_NODE)) as counter:
        for name, fn in (
            ("all_gather", lambda: funcol.all_gather_tensor(torch.ones(6), 0, mesh)),
            ("reduce_scatter", lambda: funcol.reduce_scatter_tensor(torch.ones(8), "sum", 0, mesh)),
            ("all_reduce", lambda: funcol.all_reduce(torch.ones(10), "sum", mesh)),
            (
                "all_to_all",
                lambda: funcol.all_to_all_single(torch.ones(sum(splits), 3), splits, splits, mesh),
            ),
            ("redistribute", lambda: a.redistribute(mesh, [Replicate()]).to_local()),
            ("dtensor_mm", lambda: torch.mm(a, b).full_tensor()),
        ):
            with counter.phase(name):
                res = fn()
                if isinstance(res, funcol.AsyncCollectiveTensor):
                    res.wait()
    out["records"] = _records(counter)
    return out


def _phases_and_nesting(rank: int) -> dict[str, Any]:
    outer = CommCounter()
    with outer:
        dist.all_reduce(torch.ones(4))  # unlabeled
        with outer.phase("p1"):
            dist.all_reduce(torch.ones(4))
            with outer.phase("p2"):
                dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(4))
        with CommCounter() as inner:
            dist.all_reduce(torch.ones(4))
        outer.set_phase("p3")
        dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4))  # not counted: outside every counter
    try:
        with outer:
            dist.all_reduce(torch.ones(4))
            raise ValueError
    except ValueError:
        pass
    dist.all_reduce(torch.ones(4))  # not counted: the exception exited the counter
    return {
        "outer_phases": [r.phase for r in outer.records],
        "inner_count": len(inner.records),
        "mode_after": _get_current_dispatch_mode() is None,
        "by_phase_count": {k: v["count"] for k, v in outer.summary()["by_phase"].items()},
        "total_p1_sent": outer.total("sent_bytes", op="all_reduce", phase="p1"),
        "total_count": outer.total("count"),
    }


def _fsdp2(rank: int) -> dict[str, Any]:
    """FSDP2 over the 1-D 'shard' dimension of a (2, 2) mesh: groups {0, 1} and {2, 3}, each inside one node."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))["shard"]
    bf16_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out: dict[str, Any] = {}
    for name, kwargs in (
        ("reshard", {"reshard_after_forward": True}),
        ("no_reshard", {"reshard_after_forward": False}),
        ("bf16", {"reshard_after_forward": True, "mp_policy": bf16_policy}),
    ):
        model = _mlp()
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=mesh, **kwargs)
        opt = torch.optim.Adam(model.parameters())
        counter = CommCounter(NodeTopology(RANKS_PER_NODE))
        attach_phase_hooks(model, counter, optimizers=[opt])
        with counter:
            model(torch.randn(3, 8)).sum().backward()
            opt.step()
        out[name] = {"records": _records(counter), "state": state_bytes(model, [opt])}

    padded = nn.Linear(8, 5)  # 5 rows do not split evenly over 2 ranks: FSDP2 pads to 6
    fully_shard(padded, mesh=mesh)
    out["padded_state"] = state_bytes(padded)
    out["padded_local_bytes"] = sum(p.to_local().numel() * FP32 for p in padded.parameters())
    return out


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor & co. are deprecated
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)  # 4 ranks share 2 cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        results = {
            "c10d": _c10d_collectives(rank),
            "subgroups": _subgroups(rank),
            "functional": _functional_and_dtensor(rank),
            "phases": _phases_and_nesting(rank),
            "fsdp2": _fsdp2(rank),
        }
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Run the 4-rank gloo launch once and return each rank's observations."""
    tmp = tmp_path_factory.mktemp("profiling_dist")
    mp.spawn(_worker, args=(WORLD, str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _only(records: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(records) == 1, records
    return records[0]


def _bytes(record: dict[str, Any]) -> tuple[int, int, int]:
    return record["tensor_bytes"], record["sent_bytes"], record["cross_node_bytes"]


# ---------------------------------------------------------------------------------------------------------------------
# Multi-process assertions
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_c10d_gather_scatter_reduce_bytes(dist_results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(dist_results):
        c = res["c10d"]
        for name in ("all_gather_into_tensor", "all_gather_single"):  # 6 floats per rank, 4 ranks
            rec = _only(c[name])
            assert rec["op"] == "all_gather_into_tensor" and rec["api"] == "c10d"
            assert _bytes(rec) == (96, 72, 48)
            assert rec["group_size"] == 4 and rec["group_ranks"] == [0, 1, 2, 3] and rec["rank"] == rank
            assert rec["dtype"] == "float32" and rec["async_op"] is False and rec["spans_nodes"] is True

        rec = _only(c["all_gather_bf16"])  # 4 bf16 per rank
        assert (rec["op"], rec["dtype"]) == ("all_gather", "bfloat16")
        assert _bytes(rec) == (32, 24, 16)

        assert _bytes(_only(c["reduce_scatter_tensor"])) == (32, 24, 16)  # input 8 floats, chunks of 2
        assert _only(c["reduce_scatter_tensor"])["op"] == "reduce_scatter_tensor"

        rec = _only(c["reduce_scatter_uneven"])  # chunks [4, 8, 12, 16] bytes, chunk j to rank j
        chunks = [4 * (j + 1) for j in range(WORLD)]
        off_node = [j for j in range(WORLD) if j // 2 != rank // 2]
        assert rec["op"] == "reduce_scatter"
        assert _bytes(rec) == (40, 40 - chunks[rank], sum(chunks[j] for j in off_node))

        rec = _only(c["all_reduce_async"])  # 40 bytes: 2*(n-1)/n*t = 60; 2*t/n per off-node peer = 2*20
        assert _bytes(rec) == (40, 60, 40) and rec["async_op"] is True
        rec = _only(c["all_reduce_bf16"])
        assert _bytes(rec) == (20, 30, 20) and rec["dtype"] == "bfloat16"
        assert _bytes(_only(c["all_reduce_uint8"])) == (7, 10, 7)  # 2*3*7/4 = 10.5 rounds down

        rec = _only(c["broadcast"])  # root 1 sends 16 bytes to each of 3 peers, 2 of them off-node
        assert rec["peer"] == 1
        assert _bytes(rec) == ((16, 48, 32) if rank == 1 else (16, 0, 0))


@pytest.mark.slow
def test_c10d_all_to_all_and_p2p_bytes(dist_results: list[dict[str, Any]]) -> None:
    expected_a2a = {0: (120, 108, 84), 1: (168, 132, 108), 2: (216, 156, 84), 3: (264, 180, 108)}
    expected_p2p = {
        0: [("send", 20, 20, 20, 2), ("recv", 20, 0, 0, 1)],
        1: [("send", 20, 20, 0, 0)],
        2: [("recv", 20, 0, 0, 0)],
        3: [],
    }
    for rank, res in enumerate(dist_results):
        c = res["c10d"]
        # rank r sends r+j+1 rows of 3 floats (12 bytes) to rank j
        rows = [rank + j + 1 for j in range(WORLD)]
        off_node = [j for j in range(WORLD) if j // 2 != rank // 2]
        hand = (12 * sum(rows), 12 * (sum(rows) - rows[rank]), 12 * sum(rows[j] for j in off_node))
        rec = _only(c["all_to_all_single_uneven"])
        assert rec["op"] == "all_to_all_single" and _bytes(rec) == hand == expected_a2a[rank]

        rec = _only(c["all_to_all"])  # 3 floats to each rank
        assert rec["op"] == "all_to_all" and _bytes(rec) == (48, 36, 24)

        got = [(r["op"], *_bytes(r), r["peer"]) for r in c["send_recv"]]
        assert got == expected_p2p[rank]
        assert all(r["async_op"] is None for r in c["send_recv"])

        ring = {r["op"]: r for r in c["batch_isend_irecv"]}
        assert set(ring) == {"send", "recv"} and len(c["batch_isend_irecv"]) == 2
        dst = (rank + 1) % WORLD
        crosses = dst // 2 != rank // 2
        assert _bytes(ring["send"]) == (8, 8, 8 if crosses else 0) and ring["send"]["peer"] == dst
        assert ring["send"]["spans_nodes"] is crosses
        assert _bytes(ring["recv"]) == (8, 0, 0) and ring["recv"]["peer"] == (rank - 1) % WORLD


@pytest.mark.slow
def test_subgroups_and_cross_node(dist_results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(dist_results):
        same_node, strided = res["subgroups"]["records"]
        assert same_node["group_ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1] and same_node["group_size"] == 2
        assert _bytes(same_node) == (16, 16, 0) and same_node["spans_nodes"] is False
        assert strided["group_ranks"] == [rank % 2, rank % 2 + 2]
        assert _bytes(strided) == (16, 16, 16) and strided["spans_nodes"] is True
        summary = res["subgroups"]["summary"]
        assert summary["by_group_size"]["2"]["count"] == 2
        assert summary["totals"] == {"count": 2, "tensor_bytes": 32, "sent_bytes": 32, "cross_node_bytes": 16}
        assert res["subgroups"]["sent_cross_node_groups"] == 16 and res["subgroups"]["sent_node_local_groups"] == 16
        assert res["subgroups"]["by_op"] == {"all_reduce": 16}


@pytest.mark.slow
def test_functional_collectives_and_dtensor(dist_results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(dist_results):
        records = res["functional"]["records"]
        by_phase: dict[str, list[dict[str, Any]]] = {}
        for r in records:
            by_phase.setdefault(r["phase"], []).append(r)
            assert r["api"] == "functional" and r["async_op"] is True and r["group_ranks"] == [0, 1, 2, 3]
        rows = [rank + j + 1 for j in range(WORLD)]
        off_node = [j for j in range(WORLD) if j // 2 != rank // 2]
        expected = {
            "all_gather": ("all_gather_into_tensor", (96, 72, 48)),
            "reduce_scatter": ("reduce_scatter_tensor", (32, 24, 16)),
            "all_reduce": ("all_reduce", (40, 60, 40)),
            "all_to_all": (
                "all_to_all_single",
                (12 * sum(rows), 12 * (sum(rows) - rows[rank]), 12 * sum(rows[j] for j in off_node)),
            ),
            "redistribute": ("all_gather_into_tensor", (128, 96, 64)),  # 2x4 fp32 local shard
        }
        for phase, (op, nbytes) in expected.items():
            rec = _only(by_phase[phase])
            assert (rec["op"], _bytes(rec)) == (op, nbytes), phase
        # DTensor desugars mm into functional collectives while it dispatches the op; they must be seen.
        assert any(r["op"] == "all_gather_into_tensor" for r in by_phase["dtensor_mm"])


@pytest.mark.slow
def test_phases_and_nesting_with_real_collectives(dist_results: list[dict[str, Any]]) -> None:
    for res in dist_results:
        ph = res["phases"]
        assert ph["outer_phases"] == ["unlabeled", "p1", "p2", "p1", "unlabeled", "p3", "p3"]
        assert ph["inner_count"] == 1  # the nested counter saw the op the outer one saw too
        assert ph["mode_after"] is True
        assert ph["by_phase_count"] == {"unlabeled": 2, "p1": 2, "p2": 1, "p3": 2}
        assert ph["total_p1_sent"] == 2 * 24  # 16-byte all-reduce on 4 ranks: 2*3/4*16
        assert ph["total_count"] == 7


def _fsdp_sum(records: list[dict[str, Any]], op: str, phase: str, field: str = "tensor_bytes") -> int:
    return sum(r[field] for r in records if r["op"] == op and r["phase"] == phase)


@pytest.mark.slow
def test_fsdp2_forward_backward_is_counted(dist_results: list[dict[str, Any]]) -> None:
    """One fp32 step of a 2-Linear model (848 bytes of parameters) fully sharded over 2 ranks.

    Forward all-gathers every parameter once (848 bytes). With ``reshard_after_forward=True`` both Linear layers are
    freed after forward and all-gathered again in backward (another 848: the root holds no parameters of its own, so
    FSDP2's "root is not resharded" rule exempts nothing); with ``False`` backward all-gathers nothing. Reduce-scatter
    moves the full gradient (848 bytes) once. Each group {0, 1}/{2, 3} lies within one node: no cross-node bytes.
    """
    for rank, res in enumerate(dist_results):
        for name, backward_ag in (("reshard", MLP_PARAM_BYTES), ("no_reshard", 0)):
            records = res["fsdp2"][name]["records"]
            assert _fsdp_sum(records, "all_gather_into_tensor", "forward") == MLP_PARAM_BYTES
            assert _fsdp_sum(records, "all_gather_into_tensor", "backward") == backward_ag
            assert _fsdp_sum(records, "reduce_scatter_tensor", "backward") == MLP_PARAM_BYTES
            assert _fsdp_sum(records, "reduce_scatter_tensor", "forward") == 0
            assert {r["op"] for r in records} == {"all_gather_into_tensor", "reduce_scatter_tensor"}
            assert all(r["dtype"] == "float32" and r["group_size"] == 2 for r in records)
            assert all(r["group_ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1] for r in records)
            assert sum(r["cross_node_bytes"] for r in records) == 0
            # sent = (n-1)/n of the payload for both all-gather and reduce-scatter with n = 2
            assert sum(r["sent_bytes"] for r in records) == sum(r["tensor_bytes"] for r in records) // 2


@pytest.mark.slow
def test_fsdp2_mixed_precision_dtypes(dist_results: list[dict[str, Any]]) -> None:
    """param_dtype=bf16 all-gathers bf16 (half the bytes); reduce_dtype=fp32 reduce-scatters fp32."""
    for res in dist_results:
        records = res["fsdp2"]["bf16"]["records"]
        gathers = [r for r in records if r["op"] == "all_gather_into_tensor"]
        scatters = [r for r in records if r["op"] == "reduce_scatter_tensor"]
        assert gathers and scatters
        assert {r["dtype"] for r in gathers} == {"bfloat16"}
        assert {r["dtype"] for r in scatters} == {"float32"}
        assert _fsdp_sum(records, "all_gather_into_tensor", "forward") == MLP_PARAM_BYTES // 2
        assert _fsdp_sum(records, "reduce_scatter_tensor", "backward") == MLP_PARAM_BYTES


@pytest.mark.slow
def test_fsdp2_state_bytes(dist_results: list[dict[str, Any]]) -> None:
    for res in dist_results:
        state = res["fsdp2"]["reshard"]["state"]
        half = MLP_PARAM_BYTES // 2  # every dim 0 (16, 16, 4, 4) splits evenly over 2 ranks
        assert state["parameters"] == half and state["gradients"] == half and state["buffers"] == 0
        assert state["optimizer_state"] == 2 * half + 4 * FP32  # exp_avg, exp_avg_sq shards + 4 step scalars
        # Linear(8, 5): 5 rows are padded to 6, so each rank holds a 3-row storage (24 + 3 floats).
        plain = (5 * 8 + 5) * FP32
        assert res["fsdp2"]["padded_state"]["parameters"] == (3 * 8 + 3) * FP32
        assert plain / 2 <= res["fsdp2"]["padded_state"]["parameters"] <= plain / 2 + (8 + 1) * FP32
    # Unpadded local shards add up to the full parameters across the 2 ranks of a group.
    assert dist_results[0]["fsdp2"]["padded_local_bytes"] + dist_results[1]["fsdp2"]["padded_local_bytes"] == plain
