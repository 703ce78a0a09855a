"""How close the mesh planner's per-rank estimates are to real multi-process runs (CPU, gloo, ``32-true``).

For each mesh, one launch of ``world_size`` processes (Lightning's launcher re-runs this file per rank) trains each
model size for ``--steps`` (2) optimizer steps under the strategy that runs that mesh today, and measures on every
rank:

- state bytes after the first step, exactly: the storages of the parameters the optimizer steps (DTensors: their
  local shard, padding included), of their gradients, and of the optimizer's state tensors (AdamW's ``step``
  included);
- the activation peak of each step: the most bytes autograd held saved for backward at once (a saved-tensor hook
  counts each distinct storage from the moment it is saved until autograd lets it go; parameters and views of them
  are not activations). The last step's is compared; the first step's is shown too (under ``pipeline`` torch's
  stage set-up runs one extra forward whose graph stays partly alive through the first step).

The largest value over the ranks (the fuller pipeline stage) is compared with :func:`~lightning_dist.planning.
recommend.estimate_mesh` for the same model, mesh and workload. Usage::

    python -m benchmarks.planner_accuracy                       # 3 sizes × 5 meshes, a markdown table
    python -m benchmarks.planner_accuracy --meshes tp=2 --sizes S
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
from torch import nn

from benchmarks.common.launch import child_env, run_command

SEQ_LEN = 64
MICRO_BATCH = 2  # samples per data-parallel rank per forward
PIPELINE_MICROBATCHES = 4  # pp: the per-replica batch is MICRO_BATCH × this, split by the schedule
PRECISION = "32-true"
STEPS = 2  # activations: the peak of the last step (the first can differ, see the table notes)


@dataclass(frozen=True)
class LlamaSize:
    """A tiny ``transformers.LlamaForCausalLM`` (untied head, grouped-query attention, SDPA)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def build(self) -> nn.Module:
        """The model as a LightningModule (``self.model`` is the ``LlamaForCausalLM``)."""
        return _lightning_module()(self)


SIZES = {
    s.name: s
    for s in (
        LlamaSize("S", hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, vocab=512),
        LlamaSize("M", hidden=128, intermediate=352, layers=4, heads=8, kv_heads=4, vocab=1024),
        LlamaSize("L", hidden=256, intermediate=688, layers=4, heads=8, kv_heads=4, vocab=2048),
    )
}

# mesh -> (strategy, its options); every mesh here has 2 ranks unless it says otherwise
MESHES: dict[str, tuple[str, dict[str, Any]]] = {
    "dp_shard=2": ("fsdp2", {"data_parallel_shard_size": 2, "data_parallel_replicate_size": 1}),
    "tp=2": ("tensor_parallel", {"tensor_parallel_size": 2, "data_parallel_shard_size": 1}),
    "pp=2": ("pipeline", {"pipeline_parallel_size": 2, "schedule": "1f1b", "n_microbatches": PIPELINE_MICROBATCHES}),
    "cp=2": ("context_parallel", {"context_parallel_size": 2}),
    "dp_shard=2 × tp=2": ("tensor_parallel", {"tensor_parallel_size": 2, "data_parallel_shard_size": 2}),
}
DEFAULT_MESHES = ("dp_shard=2", "tp=2", "pp=2", "cp=2", "dp_shard=2 × tp=2")


def parse_mesh(name: str) -> Any:
    from lightning_dist.parallel.mesh import ParallelDims

    return ParallelDims(**{k.strip(): int(v) for k, v in (part.split("=") for part in name.split("×"))})


def batch_per_replica(mesh: Any) -> int:
    return MICRO_BATCH * (PIPELINE_MICROBATCHES if mesh.pp > 1 else 1)


# ---------------------------------------------------------------------------------------------------------- model


def _lightning_module() -> type:
    import lightning as L
    import torch.nn.functional as F

    class _LlamaLM(L.LightningModule):
        """``self.model`` is a stock ``LlamaForCausalLM``; labels come aligned per position (next tokens)."""

        def __init__(self, size: LlamaSize) -> None:
            super().__init__()
            from transformers import LlamaConfig, LlamaForCausalLM

            config = LlamaConfig(
                vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                max_position_embeddings=SEQ_LEN, tie_word_embeddings=False, attn_implementation="sdpa",
                bos_token_id=0, eos_token_id=1,
            )  # fmt: skip
            self.model = LlamaForCausalLM(config)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids).logits

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            logits = self.model(input_ids=batch["input_ids"]).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return _LlamaLM


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, samples: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (samples, SEQ_LEN + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


# ------------------------------------------------------------------------------------------------ measurement


class _Held:
    """What the pack hook hands autograd instead of a saved tensor: releasing it releases the tensor."""

    __slots__ = ("key", "tensor", "tracker")

    def __init__(self, tracker: SavedPeak, key: Any, tensor: torch.Tensor) -> None:
        self.tracker, self.key, self.tensor = tracker, key, tensor

    def __del__(self) -> None:
        self.tracker.release(self.key)


class SavedPeak:
    """Peak bytes autograd keeps saved for backward at once, by distinct storage (a DTensor: its local shard).

    Parameters and views of them (a saved ``weight.t()``; FSDP2's unsharded parameters) are not counted.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._held: dict[Any, list[int]] = {}  # storage -> [references, bytes]
        self._ctx: Any = None

    def pack(self, t: torch.Tensor) -> Any:
        from lightning_dist.profiling.memory import _storage_key_and_bytes

        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter):
            return t
        local = getattr(t, "_local_tensor", t)  # DTensor: this rank's shard
        key, nbytes = _storage_key_and_bytes(local)
        entry = self._held.get(key)
        if entry is None:
            self._held[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Held(self, key, t)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: Any) -> None:
        entry = self._held.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._held[key]
            self.live -= entry[1]

    def __enter__(self) -> SavedPeak:  # noqa: PYI034
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def state_of(trainer: Any) -> dict[str, int]:
    """Bytes of this rank's parameters, their gradients and the optimizer state, each storage once."""
    from lightning_dist.profiling import state_bytes

    counted = state_bytes(trainer.lightning_module, trainer.optimizers)
    return {"params": counted["parameters"], "grads": counted["gradients"], "optimizer": counted["optimizer_state"]}


def _measure_callback() -> Any:
    from lightning.pytorch.callbacks import Callback

    class Measure(Callback):
        """State bytes after the first optimizer step; the activation peak of every step."""

        def __init__(self) -> None:
            self.peak = SavedPeak()
            self.result: dict[str, Any] = {"activations_by_step": []}

        def on_train_batch_start(self, *args: Any) -> None:
            self.peak = SavedPeak().__enter__()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:  # after the optimizer step
            self.peak.__exit__(None, None, None)
            self.result["activations_by_step"].append(self.peak.peak)
            if len(self.result["activations_by_step"]) == 1:
                self.result.update(state_of(trainer))

    return Measure()


def _strategy(mesh_name: str) -> Any:
    import lightning_dist as ld

    kind, options = MESHES[mesh_name]
    cls = {
        "fsdp2": ld.FSDP2Strategy,
        "tensor_parallel": ld.TensorParallelStrategy,
        "pipeline": ld.PipelineStrategy,
        "context_parallel": ld.ContextParallelStrategy,
    }[kind]
    return cls(**options)


def run_rank(mesh_name: str, size_names: list[str], steps: int = STEPS) -> dict[str, list[dict[str, Any]]]:
    """On every rank of a launch: one step of each size under ``mesh_name``; returns every rank's measurements."""
    import lightning as L
    import torch.distributed as dist

    mesh = parse_mesh(mesh_name)
    out: dict[str, list[dict[str, Any]]] = {}
    for name in size_names:
        L.seed_everything(0, verbose=False)
        model = SIZES[name].build()
        measure = _measure_callback()
        data = torch.utils.data.DataLoader(
            RandomTokens(SIZES[name].vocab, 8 * mesh.world_size), batch_size=batch_per_replica(mesh)
        )
        trainer = L.Trainer(
            accelerator="cpu", devices=mesh.world_size, strategy=_strategy(mesh_name), precision=PRECISION,
            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[measure],
        )  # fmt: skip
        trainer.fit(model, train_dataloaders=data)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, measure.result)
        out[name] = gathered
    return out


# --------------------------------------------------------------------------------------------------- driver


def launch(
    mesh_name: str, size_names: list[str], workdir: Path, steps: int = STEPS, timeout: float = 600
) -> dict[str, Any]:
    """Run :func:`run_rank` in ``world_size`` real processes; rank 0's JSON (every rank's measurements)."""
    mesh = parse_mesh(mesh_name)
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / f"planner_accuracy_{abs(hash((mesh_name, *size_names))) % 10**8}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--meshes", mesh_name,
           "--sizes", ",".join(size_names), "--steps", str(steps), "--out", str(out)]  # fmt: skip
    env = child_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = run_command(cmd, cwd=workdir, env=env, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{mesh} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    return json.loads(out.read_text())


def estimated(size_name: str, mesh_name: str) -> dict[str, float]:
    """The planner's per-rank figures for the same model, mesh and workload as the run."""
    from lightning_dist.planning.recommend import estimate_mesh

    mesh = parse_mesh(mesh_name)
    with torch.device("meta"):
        model = SIZES[size_name].build()
    est = estimate_mesh(
        model, mesh, seq_len=SEQ_LEN, micro_batch=MICRO_BATCH,
        global_batch=batch_per_replica(mesh) * mesh.batch, precision=PRECISION,
    )  # fmt: skip
    return {"params": est.params, "grads": est.grads, "optimizer": est.optimizer, "activations": est.activations}


KEYS = ("params", "grads", "optimizer", "activations")


def rows(mesh_names: list[str], size_names: list[str], workdir: Path, steps: int = STEPS) -> list[dict[str, Any]]:
    """One row per (size, mesh): estimated and measured (the largest over the ranks) per-rank bytes."""
    found = []
    for mesh_name in mesh_names:
        measured = launch(mesh_name, size_names, workdir, steps)
        for size_name in size_names:
            per_rank = measured[size_name]
            worst = {k: max(r[k] for r in per_rank) for k in KEYS[:3]}
            worst["activations"] = max(r["activations_by_step"][-1] for r in per_rank)
            worst["activations_first_step"] = max(r["activations_by_step"][0] for r in per_rank)
            found.append(
                {"size": size_name, "mesh": mesh_name, "estimated": estimated(size_name, mesh_name), "measured": worst}
            )
    return found


def table(found: list[dict[str, Any]]) -> str:
    head = "| model | mesh | " + " | ".join(f"{k} est. / measured KiB (ratio)" for k in KEYS)
    head += " | activations, first step: measured KiB (ratio) |"
    lines = [head, "|---|---|" + "---|" * (len(KEYS) + 1)]
    for r in found:
        cells = []
        for k in KEYS:
            e, m = r["estimated"][k], r["measured"][k]
            cells.append(f"{e / 1024:.1f} / {m / 1024:.1f} ({e / m:.3f})")
        size = SIZES[r["size"]]
        label = f"{r['size']} (h{size.hidden}, {size.layers} layers, V{size.vocab})"
        first = r["measured"]["activations_first_step"]
        cells.append(f"{first / 1024:.1f} ({r['estimated']['activations'] / first:.3f})")
        lines.append(f"| {label} | {r['mesh']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--meshes", default=",".join(DEFAULT_MESHES), help="comma-separated, from " + ", ".join(MESHES))
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per run (activations: the last one's)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = args.sizes.split(",")
    if args.worker:
        result = run_rank(args.meshes, sizes, args.steps)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(result))
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="planner_accuracy_"))
    found = rows(args.meshes.split(","), sizes, workdir, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))
    print(
        f"Per rank (largest over ranks), AdamW, {PRECISION}, seq {SEQ_LEN}, micro-batch {MICRO_BATCH}"
        f" (pp: {PIPELINE_MICROBATCHES} micro-batches, 1F1B); states after step 1, activations of step {args.steps};"
        " ratio = estimated / measured."
    )
    print(table(found))


if __name__ == "__main__":
    main()
