"""ZeRO++ scenarios on 4 ranks declared as 2 nodes × 2: parity with fsdp2, communication bytes, stale weights, and
checkpoints crossing between zeropp and fsdp2.

python tests/scenarios/zeropp_runs.py --devices 4 --out r.json --workdir DIR --scenarios parity,bytes
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import (  # type: ignore[import-not-found]
    RANKS_PER_NODE,
    ZEROPP_MODEL,
    StepBytes,
    StepRecorder,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_dist import FSDP2Strategy, ZeroPPPrecision, ZeroPPStrategy
from lightning_dist.parallel.quantization import qmax
from lightning_dist.parallel.zeropp import (
    QuantizedAllGather,
    QuantizedReduceScatter,
    new_node_groups,
    reduce_scatter_nbytes,
)
from lightning_dist.profiling import CommCounter, NodeTopology
from lightning_dist.strategies.lifecycle.step_protocol import StepProtocol

PARITY_STEPS = 20
ZEROPP_VARIANTS: dict[str, dict[str, Any]] = {
    "zeropp": {},
    "zeropp_qwz": {"hpz_partition_size": None, "quantized_gradients": False},
    "zeropp_hpz": {"quantized_weights": False, "quantized_gradients": False},
    "zeropp_qgz": {"quantized_weights": False, "hpz_partition_size": None},
}


#: "zeropp" as a DeepSpeed ZeRO++ config writes it (as DeepSpeedStrategy(config=...) takes it), with keys that only
#: tune DeepSpeed's buffers and the Trainer's keys beside the ZeRO++ ones.
DEEPSPEED_ZEROPP = {
    "zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": RANKS_PER_NODE,
                          "zero_quantized_gradients": True, "reduce_bucket_size": 5e8, "overlap_comm": True},
    "bf16": {"enabled": True},
    "train_micro_batch_size_per_gpu": 2,
}  # fmt: skip


def make_strategy(name: str, **kwargs: Any) -> Any:
    if name == "zeropp_deepspeed_config":
        return ZeroPPStrategy(ranks_per_node=RANKS_PER_NODE, config=DEEPSPEED_ZEROPP, **kwargs)
    if name == "fsdp2":
        return FSDP2Strategy(**kwargs)
    if name == "fsdp2_bf16_reduce":  # the byte baseline: bf16 both ways
        return FSDP2Strategy(precision_plugin=ZeroPPPrecision("bf16-mixed", reduce_dtype="bf16"), **kwargs)
    return ZeroPPStrategy(ranks_per_node=RANKS_PER_NODE, **ZEROPP_VARIANTS[name], **kwargs)


def fit(
    name: str,
    devices: int,
    steps: int,
    precision: str | None = "bf16-mixed",
    callbacks: list[Callback] = (),
    strategy: Any = None,
    model_kwargs: dict | None = None,
    **trainer_overrides: Any,
) -> tuple[L.Trainer, StepRecorder]:
    model, data = make_model_and_data(devices, **(model_kwargs or ZEROPP_MODEL))
    recorder = StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy or make_strategy(name), **trainer_overrides),
        **({"precision": precision} if precision else {}),
        max_steps=steps,
        callbacks=[recorder, *callbacks],
    )
    trainer.fit(model, data)
    return trainer, recorder


def run(name: str, devices: int, steps: int = PARITY_STEPS, precision: str = "bf16-mixed") -> dict[str, Any]:
    """``steps`` steps (bf16-mixed by default); the collectives of step 1 are counted."""
    counting = StepBytes()
    _, recorder = fit(name, devices, steps, precision=precision, callbacks=[counting])
    return {"losses": recorder.losses, "bytes": counting.table()}


def baseline_bytes(devices: int) -> dict[str, Any]:
    """fsdp2 communicating bf16 both ways (all-gather in bf16 by bf16-mixed, reduce-scatter by reduce_dtype=bf16)."""
    counting = StepBytes()
    fit("fsdp2_bf16_reduce", devices, 2, callbacks=[counting])
    dtypes = sorted({str(r.dtype) for r in counting.counter.records if r.op != "all_reduce"})
    return {"bytes": counting.table(), "dtypes": dtypes}


class NoGradForwardAfterBackward(Callback):
    """A no_grad forward between backward and the optimizer step: with hpZ it leaves every unit holding a slice of the
    pre-step weights, which the next forward would use unless the strategy reshards before the step."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.batch = batch

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with torch.no_grad():
            trainer.strategy.model(self.batch["input_ids"])


class _NoReshardBeforeStep(ZeroPPStrategy):
    """hpZ without the reshard before the optimizer step: shows the stale-weight sequence is real."""

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return super(StepProtocol, self).optimizer_step(optimizer, closure, model, **kwargs)  # Lightning's


def stale_weights(devices: int) -> dict[str, Any]:
    steps = 4
    out = {}
    for name, strategy in (
        ("fsdp2", FSDP2Strategy()),
        ("zeropp_hpz", make_strategy("zeropp_hpz")),
        (
            "zeropp_hpz_unprotected",
            _NoReshardBeforeStep(ranks_per_node=RANKS_PER_NODE, **ZEROPP_VARIANTS["zeropp_hpz"]),
        ),
    ):
        _, recorder = fit(name, devices, steps, callbacks=[NoGradForwardAfterBackward()], strategy=strategy)
        out[name] = recorder.losses
    return out


def checkpoints(devices: int, workdir: str) -> dict[str, Any]:
    """Save at step 3 under one strategy and resume under the other (fp32 weights, 6 steps)."""
    steps, samples = 6, 24  # 3-step epochs: the step-3 checkpoint resumes at an epoch boundary
    out: dict[str, Any] = {}
    for saver in ("fsdp2", "zeropp"):
        ckpt = ModelCheckpoint(
            dirpath=f"{workdir}/zp_ckpt_{saver}", every_n_train_steps=3, save_top_k=-1, filename="{step}"
        )
        _, recorder = fit(
            saver,
            devices,
            steps,
            precision="32-true",
            callbacks=[ckpt],
            model_kwargs={**ZEROPP_MODEL, "train_samples": samples},
            enable_checkpointing=True,
        )
        out[f"{saver}_saved"] = recorder.losses
    for saver, loader in (("fsdp2", "zeropp"), ("zeropp", "fsdp2"), ("fsdp2", "zeropp_hpz")):
        model, data = make_model_and_data(devices, train_samples=samples, **ZEROPP_MODEL)
        recorder = StepRecorder()
        trainer = L.Trainer(
            **trainer_kwargs(devices, strategy=make_strategy(loader), precision="32-true"),
            max_steps=steps,
            callbacks=[recorder],
        )
        trainer.fit(model, data, ckpt_path=f"{workdir}/zp_ckpt_{saver}/step=3.ckpt")
        out[f"{loader}_from_{saver}"] = {"losses": recorder.losses, "global_step": trainer.global_step}
    return out


def precisions(devices: int) -> dict[str, Any]:
    """Full zeropp for 3 steps in the precisions not covered above (fp16 with loss scaling, pure bf16)."""
    out = {}
    for flag in ("16-mixed", "bf16-true"):
        strategy = ZeroPPStrategy(ranks_per_node=RANKS_PER_NODE, precision_plugin=ZeroPPPrecision(flag))
        _, recorder = fit("zeropp", devices, 3, strategy=strategy, precision=None)
        out[flag] = recorder.losses
    return out


COMM_SIZES = [1, 2, 3, 7, 13, 97, 1031]  # elements per rank: tiny, prime, more than a block


def comms(devices: int) -> dict[str, Any]:
    """The quantized collectives alone, on this launch's process group (run after a fit scenario created it).

    Every rank builds every rank's input from a shared seed, so each can compute the exact result in fp64 itself.
    """
    if not dist.is_initialized():
        raise RuntimeError("the comms scenario needs the process group of an earlier fit scenario")
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = new_node_groups(list(range(world)), RANKS_PER_NODE)
    group = dist.group.WORLD
    rs_cases = []
    for bits in (4, 8):
        rs = QuantizedReduceScatter(groups, bits=bits, block_size=8)
        for c in COMM_SIZES:
            for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
                inputs = torch.randn(world, world * c, generator=torch.Generator().manual_seed(1000 * c + bits))
                inputs[:, : world * c // 2] *= 10  # blocks of very different scales
                out = torch.empty(c)
                rs(out, inputs[rank].clone(), group, op)
                mine = inputs.double().view(world, world, c)[:, rank]  # what every rank sent to this one
                total = mine.sum(0)
                node = rank // RANKS_PER_NODE
                node_mean = mine[node * RANKS_PER_NODE : (node + 1) * RANKS_PER_NODE].mean(0)
                expected = total / world if op == dist.ReduceOp.AVG else total
                rs_cases.append(
                    {
                        "bits": bits,
                        "c": c,
                        "op": "avg" if op == dist.ReduceOp.AVG else "sum",
                        "err": float((out.double() - expected).abs().max()),
                        "sum_gap": float((total - expected).abs().max()),  # how far a wrong reduction would be
                        "node_mean_gap": float((node_mean - expected).abs().max()),
                        "max_abs_input": float(inputs.abs().max()),
                    }
                )
    constants = []
    for bits in (4, 8):  # rank r sends r + 1 everywhere: on the grid, so the mean is exact
        out = torch.empty(13)
        QuantizedReduceScatter(groups, bits=bits, block_size=4)(
            out, torch.full((world * 13,), rank + 1.0), group, dist.ReduceOp.AVG
        )
        constants.append(out.tolist())
    ag_cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ag = QuantizedAllGather(world, bits=8, block_size=16)
        for n in COMM_SIZES:
            shards = torch.randn(world, n, generator=torch.Generator().manual_seed(n)).to(dtype)
            output = torch.empty(world * n, dtype=dtype)
            output[rank * n : (rank + 1) * n] = shards[rank]
            ag(output, output[rank * n : (rank + 1) * n], group)
            step = shards.float().abs().amax(dim=1, keepdim=True) / qmax(8)  # a row's max bounds its blocks' max
            err = (output.view(world, n).float() - shards.float()).abs()
            rounding = shards.float().abs() * torch.finfo(dtype).eps
            ag_cases.append(
                {
                    "dtype": str(dtype),
                    "n": n,
                    "within_half_step": bool((err <= step / 2 + rounding + 1e-12).all()),
                    "digest": hashlib.sha1(output.view(torch.uint8).numpy().tobytes()).hexdigest(),
                }
            )
    c = 1031
    with CommCounter(NodeTopology(RANKS_PER_NODE)) as counter:
        QuantizedReduceScatter(groups, bits=4, block_size=256)(
            torch.empty(c), torch.randn(world * c), group, dist.ReduceOp.AVG
        )
    mine = {
        "rs": rs_cases,
        "constants": constants,
        "ag": ag_cases,
        "bytes": {
            "sent": counter.total("sent_bytes"),
            "cross": counter.total("cross_node_bytes"),
            "expected": reduce_scatter_nbytes(world * c, groups, 4, 256),
        },
    }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


SCENARIOS: dict[str, Callable[[int, str], Any]] = {
    "fsdp2": lambda d, w: run("fsdp2", d),
    "zeropp": lambda d, w: run("zeropp", d),
    "zeropp_qwz": lambda d, w: run("zeropp_qwz", d),
    "zeropp_hpz": lambda d, w: run("zeropp_hpz", d),
    "zeropp_qgz": lambda d, w: run("zeropp_qgz", d, steps=2),  # bytes only
    "zeropp_deepspeed_config": lambda d, w: run("zeropp_deepspeed_config", d, steps=2),  # bytes only
    "fsdp2_fp32": lambda d, w: run("fsdp2", d, precision="32-true"),
    "baseline_bytes": lambda d, w: baseline_bytes(d),
    "stale_weights": lambda d, w: stale_weights(d),
    "comms": lambda d, w: comms(d),
    "precisions": lambda d, w: precisions(d),
    "checkpoints": checkpoints,
}


if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
