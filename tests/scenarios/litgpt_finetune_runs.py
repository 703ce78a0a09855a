"""litgpt's own ``finetune lora`` script (``litgpt.finetune.lora.setup``, litgpt 0.5.x) run as it is, with its strategy
line changed to a lightning_dist Fabric strategy: litgpt's script builds ``ModelParallelStrategy(parallelize_fn=...)``
for several devices, and the scenario hands it ours instead (what a user does by editing that one line). The model
is a tiny litgpt checkpoint folder with a word tokenizer, the data a JSON file of identical instruction samples (so
that one process and any data-parallel split see the same batches); the losses are read from litgpt's CSV log.

python tests/scenarios/litgpt_finetune_runs.py --devices 2 --out r.json --workdir DIR --scenarios fsdp2
python tests/scenarios/litgpt_finetune_runs.py --devices 1 --out r.json --workdir DIR --scenarios single
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import torch
from common import run_scenario_script  # type: ignore[import-not-found]
from models import save_litgpt_folder, save_tiny_tokenizer  # type: ignore[import-not-found]

import lightning_dist.fabric

STEPS = 4
LORA = {"lora_r": 4, "lora_alpha": 8, "lora_query": True, "lora_value": True}
GLOBAL = {"single": 2, "fsdp2": 2, "tensor_parallel": 2}
MICRO = {"single": 2, "fsdp2": 1, "tensor_parallel": 2}


def prepare(devices: int, workdir: str | None) -> dict[str, Any]:
    """The checkpoint folder (litgpt's ``lit_model.pth``, ``model_config.yaml``, a tokenizer) and the data file."""
    from dataclasses import asdict

    from litgpt import lora
    from litgpt.config import Config

    folder = Path(workdir or ".")
    torch.manual_seed(0)
    save_litgpt_folder(folder / "checkpoint")
    save_tiny_tokenizer(folder / "checkpoint")
    # The adapters' init is drawn per rank on the meta-device path (world size > 1: litgpt builds the model under
    # init_module(empty_init=True), as with its own strategy): the folder carries one init that every run loads.
    config = Config.from_file(folder / "checkpoint" / "model_config.yaml")
    adapters = lora.GPT(lora.Config(**asdict(config), **LORA)).state_dict()
    weights = torch.load(folder / "checkpoint" / "lit_model.pth", weights_only=True)
    weights.update({k: v.to(torch.bfloat16) for k, v in adapters.items() if "lora_" in k})
    torch.save(weights, folder / "checkpoint" / "lit_model.pth")
    samples = [{"instruction": "name a color", "input": "", "output": "red green blue"} for _ in range(16)]
    (folder / "data.json").write_text(json.dumps(samples))
    return {}


def finetune(devices: int, workdir: str | None, strategy: str) -> dict[str, Any]:
    import litgpt.finetune.lora as script
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON

    folder = Path(workdir or ".")
    checkpoint, data = folder / "checkpoint", folder / "data.json"
    out = folder / f"out_{strategy}"
    if strategy != "single":  # the one line a user changes in litgpt/finetune/lora.py
        chosen = {"fsdp2": lambda: lightning_dist.fabric.FSDP2Strategy(),
                  "tensor_parallel": lambda: lightning_dist.fabric.TensorParallelStrategy()}[strategy]  # fmt: skip
        script.ModelParallelStrategy = lambda **litgpt_arguments: chosen()
    # litgpt saves its hyperparameters by parsing the command line as its CLI would: give it the one it expects
    sys.argv = [sys.argv[0], str(checkpoint), "--lora_r=4", "--lora_alpha=8", "--lora_dropout=0.0"]
    script.setup(
        checkpoint_dir=checkpoint,
        out_dir=out,
        precision="32-true",
        devices=devices,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        data=JSON(json_path=data, val_split_fraction=0.25, num_workers=0),
        # litgpt counts every device as data parallel (global = devices × micro × accumulation): under tp2 each
        # step's batch of 2 is "global_batch_size=4"; under fsdp2 at dp2 it is 2 micro-batches of 1
        train=TrainArgs(
            save_interval=None,
            log_interval=1,
            global_batch_size=GLOBAL[strategy] * devices // (2 if strategy == "fsdp2" else 1),
            micro_batch_size=MICRO[strategy],
            lr_warmup_steps=1,
            epochs=100,
            max_steps=STEPS,
            max_seq_length=32,
        ),  # fmt: skip
        eval=EvalArgs(interval=1000, max_new_tokens=100, max_iters=2, final_validation=True),
        optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-2}},
        logger_name="csv",
        seed=1337,
    )
    rows = list(csv.DictReader(open(next(out.glob("logs/csv/*/metrics.csv")))))
    losses = [float(r["loss"]) for r in rows if r.get("loss")]
    steps = [int(float(r["step"])) for r in rows if r.get("loss")]
    merged = (out / "final" / "lit_model.pth").exists()
    return {"losses": losses, "steps": steps, "merged": merged}


SCENARIOS = {
    "prepare": prepare,
    "single": lambda devices, workdir: finetune(devices, workdir, "single"),
    "fsdp2": lambda devices, workdir: finetune(devices, workdir, "fsdp2"),
    "tensor_parallel": lambda devices, workdir: finetune(devices, workdir, "tensor_parallel"),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
