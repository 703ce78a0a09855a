"""The ZeRO++ collectives in 4 real processes (gloo), declared as 2 nodes × 2 ranks.

The quantized reduce-scatter must return the true mean over all 4 ranks (not the sum, not a node's mean) within the
quantization error bound, for awkward sizes; the quantized all-gather must give every rank identical weights within
half a quantization step of the true ones.

Error bound of the two-hop reduce-scatter, per element, with ``M`` the largest |gradient| on any rank and ``q`` =
qmax (127 / 7): hop 1 dequantizes each of the 4 inputs with error <= M/(2q); hop 2 re-quantizes node sums (|s| <= 2M)
with error <= 2M/(2q) each, 2 of them; the sum of errors is <= 4·M/(2q) + 2·2M/(2q) = 4M/q, i.e. M/q after dividing
by 4 for the mean.
"""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dist.parallel.quantization import qmax
from lightning_dist.parallel.zeropp import (
    QuantizedAllGather,
    QuantizedReduceScatter,
    new_node_groups,
    reduce_scatter_nbytes,
)
from lightning_dist.profiling import CommCounter, NodeTopology

pytestmark = pytest.mark.slow

WORLD = 4
RANKS_PER_NODE = 2
SIZES = [1, 2, 3, 7, 13, 97, 1031]  # chunk sizes per rank: tiny, prime, over a block


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        groups = new_node_groups(list(range(WORLD)), RANKS_PER_NODE)
        world = dist.group.WORLD
        results = {"rs": [], "ag": [], "bytes": {}, "constants": []}
        for bits in (4, 8):
            out = torch.empty(13)
            QuantizedReduceScatter(groups, bits=bits, block_size=4)(
                out, torch.full((WORLD * 13,), rank + 1.0), world, dist.ReduceOp.AVG
            )
            results["constants"].append(out)
        for bits in (4, 8):
            rs = QuantizedReduceScatter(groups, bits=bits, block_size=8)
            for c in SIZES:
                for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
                    gen = torch.Generator().manual_seed(1000 * c + bits)
                    inputs = torch.randn(WORLD, WORLD * c, generator=gen)  # every rank's input, known to all
                    inputs[:, : WORLD * c // 2] *= 10  # blocks of very different scales
                    out = torch.empty(c)
                    rs(out, inputs[rank].clone(), world, op)
                    results["rs"].append((bits, c, str(op), out, inputs))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            ag = QuantizedAllGather(WORLD, bits=8, block_size=16)
            for n in SIZES:
                shards = torch.randn(WORLD, n, generator=torch.Generator().manual_seed(n)).to(dtype)
                output = torch.empty(WORLD * n, dtype=dtype)
                output[rank * n : (rank + 1) * n] = shards[rank]
                ag(output, output[rank * n : (rank + 1) * n], world)
                results["ag"].append((str(dtype), n, output, shards))
        # Bytes of one reduce-scatter through the c10d counter, against the hop formula.
        c = 1031
        with CommCounter(NodeTopology(RANKS_PER_NODE)) as counter:
            QuantizedReduceScatter(groups, bits=4, block_size=256)(
                torch.empty(c), torch.randn(WORLD * c), world, dist.ReduceOp.AVG
            )
        results["bytes"] = {
            "sent": counter.total("sent_bytes"),
            "cross": counter.total("cross_node_bytes"),
            "expected": reduce_scatter_nbytes(WORLD * c, groups, 4, 256),
        }
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(_free_port(), tmp), nprocs=WORLD, start_method="spawn", join=True)
        yield [torch.load(f"{tmp}/rank{r}.pt") for r in range(WORLD)]


def test_reduce_scatter_returns_the_mean_over_all_ranks(results):
    checked = 0
    for rank, res in enumerate(results):
        for bits, c, op, out, inputs in res["rs"]:
            chunks = inputs.view(WORLD, WORLD, c)[:, rank]  # what each rank sent to `rank`
            total = chunks.sum(0)
            expected = total / WORLD if "AVG" in op else total
            bound = inputs.abs().max() / qmax(bits) * (1 if "AVG" in op else WORLD) * (1 + 1e-5)
            err = (out - expected).abs().max()
            assert err <= bound, (rank, bits, c, op, float(err), float(bound))
            if bits == 8 and "AVG" in op:
                # The bound separates the mean from what a wrong reduction would return.
                node = rank // RANKS_PER_NODE
                node_mean = chunks[node * RANKS_PER_NODE : (node + 1) * RANKS_PER_NODE].mean(0)
                assert (out - node_mean).abs().max() > bound or torch.allclose(node_mean, expected, atol=bound)
                assert (out - total).abs().max() > bound
            checked += 1
    assert checked == WORLD * 2 * len(SIZES) * 2


def test_reduce_scatter_of_constants_is_the_exact_mean(results):
    """Rank r sends r+1 everywhere: every block is on the quantization grid, so the mean is exactly 2.5 (a sum would
    be 10, the node means 1.5 and 3.5)."""
    for res in results:
        for out in res["constants"]:
            assert torch.equal(out, torch.full_like(out, 2.5))


def test_all_gather_gives_identical_dequantized_weights(results):
    for i, entry in enumerate(results[0]["ag"]):
        dtype, n, out0, shards = entry
        for rank in range(1, WORLD):
            assert torch.equal(results[rank]["ag"][i][2], out0), (dtype, n)  # same bits on every rank
        step = shards.float().abs().amax(dim=1, keepdim=True) / qmax(8)  # block max <= row max
        err = (out0.view(WORLD, n).float() - shards.float()).abs()
        eps = {"torch.float32": 1e-7, "torch.bfloat16": 2**-8, "torch.float16": 2**-11}[dtype]
        assert (err <= step / 2 + shards.float().abs() * eps + 1e-12).all(), (dtype, n)


def test_reduce_scatter_bytes_match_the_hop_formula(results):
    for res in results:
        b = res["bytes"]
        assert b["sent"] == b["expected"]["intra"] + b["expected"]["inter"]
        assert b["cross"] == b["expected"]["inter"]
