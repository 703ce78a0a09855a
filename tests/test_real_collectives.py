"""``RealCollectiveLog`` (torch's profiler + flight recorder) against ``CommCounter`` on one real 2-rank gloo launch.

Every rank issues one of each c10d collective on the world group and on a ``new_group`` subgroup, a few functional
collectives, and an all-reduce on a one-rank group (so that a group name maps to a non-trivial rank list), with both
recorders active; the ordered (kind, bytes, group, peer) lists must agree.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from real_collectives import RealCollectiveLog

WORLD = 2
MIB = 1 << 20


def _issue(rank: int, group: dist.ProcessGroup) -> None:
    """One of each c10d collective on ``group`` (2 ranks, group rank == global rank)."""
    n = dist.get_world_size(group)
    dist.all_reduce(torch.ones(10), group=group)
    dist.all_reduce(torch.ones(7, dtype=torch.bfloat16), group=group)
    dist.all_gather_into_tensor(torch.empty(6 * n), torch.ones(6), group=group)
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n), group=group)
    dist.all_gather([torch.empty(4, dtype=torch.float64) for _ in range(n)], torch.ones(4, dtype=torch.float64), group)
    dist.reduce_scatter(torch.empty(rank + 1), [torch.ones(j + 1) for j in range(n)], group=group)
    dist.broadcast(torch.ones(4), group_src=1, group=group)
    dist.reduce(torch.ones(3), group_dst=0, group=group)
    splits = [rank + j + 1 for j in range(n)]  # uneven and symmetric: output splits equal input splits
    dist.all_to_all_single(torch.empty(sum(splits), 3), torch.ones(sum(splits), 3), splits, splits, group=group)
    dist.all_to_all([torch.empty(3) for _ in range(n)], [torch.ones(3)] * n, group=group)
    dist.gather(torch.ones(2), [torch.empty(2) for _ in range(n)] if rank == 0 else None, group_dst=0, group=group)
    dist.scatter(torch.empty(5), [torch.ones(5)] * n if rank == 0 else None, group_src=0, group=group)
    dist.all_reduce_coalesced([torch.ones(2), torch.ones(9)], group=group)
    if rank == 0:
        dist.send(torch.ones(5), group_dst=1, group=group)
    else:
        dist.recv(torch.empty(5), group_src=0, group=group)
    ops = [
        dist.P2POp(dist.isend, torch.ones(2), group_peer=1 - rank, group=group),
        dist.P2POp(dist.irecv, torch.empty(2), group_peer=1 - rank, group=group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    dist.barrier(group=group)  # no payload: recorded by neither


def _functional(rank: int) -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    splits = [rank + j + 1 for j in range(WORLD)]
    for result in (
        funcol.all_gather_tensor(torch.ones(6), 0, mesh),
        funcol.reduce_scatter_tensor(torch.ones(8), "sum", 0, mesh),
        funcol.all_reduce(torch.ones(10), "sum", mesh),
        funcol.all_to_all_single(torch.ones(sum(splits), 3), splits, splits, mesh),
    ):
        if isinstance(result, funcol.AsyncCollectiveTensor):
            result.wait()


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    from lightning_dist.profiling import CommCounter

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # pinned to CPU: gloo and CPU tensors only
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    log = RealCollectiveLog()
    with log:  # entered before the process group exists
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        sub = dist.new_group([0, 1])
        solo = [dist.new_group([0]), dist.new_group([1])]
        counter = CommCounter()
        with counter:
            log.mark("ops_start")
            _issue(rank, dist.group.WORLD)
            _issue(rank, sub)
            dist.all_reduce(torch.ones(3), group=solo[rank])
            _functional(rank)
            log.mark("ops_end")
        log.mark("mem_start")
        big = torch.ones(4 * MIB, dtype=torch.uint8)
        del big
        log.mark("mem_end")
        dist.barrier()
    dist.destroy_process_group()
    result = {
        "counter": [
            {"kind": r.op, "bytes": r.tensor_bytes, "group": list(r.group_ranks), "peer": r.peer}
            for r in counter.records
        ],
        "counter_dropped": counter.dropped,
        "log": log.collectives_between("ops_start", "ops_end"),
        "log_all": log.collectives,
        "groups_aligned": log.groups_aligned,
        "unrecognized": log.unrecognized,
        "peak_bytes": log.peak_bytes,
        "start_bytes": log.start_bytes,
        "peak_mem_window": log.peak_between("mem_start", "mem_end"),
        "peak_ops_window": log.peak_between("ops_start", "ops_end"),
        "level_at_mem_start": log.peak_during(0, log.marks["mem_start"][0]),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("real_collectives")
    start = time.perf_counter()
    mp.spawn(_worker, args=(WORLD, str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    print(f"2-rank gloo launch: {time.perf_counter() - start:.1f} s")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_log_matches_comm_counter(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        assert res["counter_dropped"] == 0
        assert res["unrecognized"] == []
        assert res["groups_aligned"], f"rank {rank}: flight recorder not aligned"
        counter, log = res["counter"], res["log"]
        assert [(c["kind"], c["bytes"]) for c in log] == [(c["kind"], c["bytes"]) for c in counter], rank
        for real, counted in zip(log, counter):
            if real["group"] is not None:
                assert real["group"] == counted["group"], (rank, real, counted)
            else:  # gloo does not log point-to-point ops in the flight recorder
                assert real["kind"] in ("send", "recv"), (rank, real)
            assert real["peer"] == counted["peer"], (rank, real, counted)
        # every non-p2p collective got its group; the one-rank group maps to this rank only
        assert all(c["group"] is not None for c in log if c["kind"] not in ("send", "recv"))
        assert [rank] in [c["group"] for c in log]
        assert res["log_all"] == log  # init, new_group and the final barrier add no collective


def test_log_covers_each_kind(ranks: list[dict[str, Any]]) -> None:
    kinds = {c["kind"] for c in ranks[0]["log"]}
    assert kinds == {
        "all_reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "reduce",
        "all_to_all_single",
        "all_to_all",
        "gather",
        "scatter",
        "send",
        "recv",
    }


def test_peak_memory(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        # the 4 MiB tensor, on top of the few bytes live at the mark, is the window's peak; the collectives' is small
        assert 4 * MIB <= res["peak_mem_window"] <= res["level_at_mem_start"] + 4 * MIB + 4096
        assert res["peak_ops_window"] < MIB
        assert res["peak_bytes"] >= res["peak_mem_window"]
        assert res["start_bytes"] >= 0
