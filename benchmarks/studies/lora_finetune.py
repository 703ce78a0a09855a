"""The LoRA fine-tuning loop of docs/finetune.md, run as a user runs it, each step timed and its peak memory
measured: a published-style folder (a stock Llama in bf16 shards with a tokenizer), ``lightning-dist fit --config
configs/finetune_lora.yaml`` (fsdp2 over 2 CPU processes, the model built on the meta device, ``initial_weights``
read after sharding, ``ExportAtFitEnd`` writing the merged bf16 folder, a last checkpoint saved), then the offline
``lightning-dist export`` of that checkpoint as the merged model (as trained and ``--dtype bfloat16``) and as the
adapter; every folder is loaded back (``from_pretrained`` strictly, ``PeftModel.from_pretrained``,
``AutoTokenizer``). Each step is a fresh process; its peak is the largest ``ru_maxrss`` of the processes it ran.

    python -m benchmarks.lora_finetune                         # 8 layers, hidden 1024, vocabulary 32000 (0.2 B)
    python -m benchmarks.lora_finetune --layers 2 --hidden 256 --vocab 4000 --steps 2   # a smoke run

The table is in docs/finetune.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import ROOT, child_env, save_published_folder

_MEASURED = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode;"
    " print('PEAK_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)"
)


def _step(command: list[str], cwd: Path) -> dict[str, Any]:
    """Run ``command`` in a fresh process; its wall time, the peak of its processes, and its output."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _MEASURED, *command], cwd=cwd, env=child_env(), capture_output=True,
                          text=True, check=False)  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    peak = int(re.findall(r"PEAK_KIB (\d+)", done.stderr)[-1]) * 1024
    return {"seconds": seconds, "peak_bytes": peak, "output": done.stdout + done.stderr}


def _folder_bytes(folder: Path) -> int:
    """The tensor bytes of the folder's safetensors files (each file less its 8-byte length and JSON header)."""
    total = 0
    for file in folder.glob("*.safetensors"):
        with file.open("rb") as f:
            total += file.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
    return total


def _config(work: Path, folder: Path, args: argparse.Namespace) -> Path:
    """configs/finetune_lora.yaml with this run's paths and sizes, and a last checkpoint saved."""
    config = yaml.safe_load((ROOT / "configs" / "finetune_lora.yaml").read_text())
    trainer = config["trainer"]
    trainer.update({"devices": args.devices, "max_steps": args.steps, "enable_checkpointing": True,
                    "default_root_dir": str(work / "run")})  # fmt: skip
    trainer["strategy"]["init_args"]["initial_weights"] = str(folder)
    trainer["callbacks"][0]["init_args"]["dirpath"] = str(work / "at_fit_end")
    trainer["callbacks"].append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                 "init_args": {"dirpath": str(work / "checkpoints"), "save_last": True}})  # fmt: skip
    config["model"]["init_args"]["folder"] = str(folder)
    config["data"]["init_args"].update({"vocab_size": args.vocab, "seq_len": args.seq_len})
    path = work / "finetune_lora.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _check_loads(work: Path, folder: Path) -> None:
    """Every folder loads as serving tools load it: strictly, with the source's tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("merged", "merged_bf16", "at_fit_end"):
        _, info = AutoModelForCausalLM.from_pretrained(work / name, output_loading_info=True)
        assert not any(info.values()), (name, info)
        assert (
            AutoTokenizer.from_pretrained(work / name)("a b 7")["input_ids"]
            == AutoTokenizer.from_pretrained(folder)("a b 7")["input_ids"]
        )
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), work / "adapter")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_finetune", description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        work, folder = Path(tmp), Path(tmp) / "llama"
        config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                             num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4)  # fmt: skip
        model = LlamaForCausalLM(config)
        parameters = sum(p.numel() for p in model.parameters())
        save_published_folder(model, folder, max_shard_size="200MB")
        del model
        cli = [sys.executable, "-m", "lightning_dist.cli"]
        last = str(work / "checkpoints" / "last.ckpt")
        steps = {
            "fit (fsdp2, 2 processes) + ExportAtFitEnd": cli + ["fit", "--config", str(_config(work, folder, args))],
            "export --format hf": cli + ["export", last, str(work / "merged"), "--format", "hf"],
            "export --format hf --dtype bfloat16": cli
            + ["export", last, str(work / "merged_bf16"), "--format", "hf", "--dtype", "bfloat16"],
            "export --format peft": cli + ["export", last, str(work / "adapter"), "--format", "peft"],
        }
        rows = {name: _step(command, ROOT) for name, command in steps.items()}
        fit = rows["fit (fsdp2, 2 processes) + ExportAtFitEnd"]["output"]
        load = re.search(r"initial_weights: .* in ([\d.]+) s", fit)
        at_end = re.search(r"ExportAtFitEnd: wrote .* in ([\d.]+) s", fit)
        _check_loads(work, folder)
        sizes = {"published (bf16)": _folder_bytes(folder), "merged (as trained, fp32)": _folder_bytes(work / "merged"),
                 "merged --dtype bfloat16": _folder_bytes(work / "merged_bf16"),
                 "at fit end (bfloat16)": _folder_bytes(work / "at_fit_end"),
                 "adapter": _folder_bytes(work / "adapter")}  # fmt: skip
    result = {
        "parameters": parameters,
        "steps": {name: {k: v for k, v in row.items() if k != "output"} for name, row in rows.items()},
        "initial_weights_seconds": float(load.group(1)) if load else None,
        "export_at_fit_end_seconds": float(at_end.group(1)) if at_end else None,
        "bytes": sizes,
    }
    print(f"stock Llama, {parameters / 1e6:.0f} M parameters, {args.layers} layers, hidden {args.hidden}, vocabulary"
          f" {args.vocab}; LoRA r=8 on q_proj and v_proj; {args.steps} steps of 2 × {args.seq_len} tokens per rank")  # fmt: skip
    print("| step | time (s) | peak memory of its largest process (GiB) |\n|---|---|---|")
    for name, row in result["steps"].items():
        print(f"| {name} | {row['seconds']:.1f} | {row['peak_bytes'] / 2**30:.2f} |")
    print(f"initial_weights read in {result['initial_weights_seconds']} s; ExportAtFitEnd took"
          f" {result['export_at_fit_end_seconds']} s")  # fmt: skip
    print("| folder | safetensors bytes (MiB) |\n|---|---|")
    for name, size in sizes.items():
        print(f"| {name} | {size / 2**20:.1f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
