"""``initial_weights`` under every strategy (issue 42): a stock ``LlamaForCausalLM`` saved in bf16 into 3 shards, built
from its config under ``trainer.init_module(empty_init=True)``, loads each rank's slices after sharding and trains as
one process that called ``from_pretrained`` (fp64, ≤ 1e-10), its tensors right after the load equal to the file's
exactly; a stock Mixtral under expert parallelism (its file's per-expert tensors into stacked experts); GPT-2's
embedding tied to its head across pipeline stages; ``ckpt_path`` wins over ``initial_weights``; bad
input refused before launch. One launch of 4 processes runs every strategy (``tests/scenarios/
pretrained_strategy_runs.py``); the reference runs here, in this process.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from launch import FULL_MATRIX, run_scenarios

from lightning_dist import FSDP2Strategy
from lightning_dist.checkpoint import CheckpointError

FP64_TOL = 1e-10
STEPS, GLOBAL_BATCH = 3, 4
# LIGHTNING_DIST_FULL_MATRIX=1 adds pp_llama and tp_llama (hybrid_llama loads pipeline stages and tensor-parallel
# slices of the same model, pp_gpt2 a tied pipeline) and fsdp2_litgpt (tp_litgpt runs FSDP2 over dp 2 too)
TRAINING_RUNS = ["fsdp2_llama", "cp_llama", "hybrid_llama", "ep_mixtral", "pp_gpt2", "tp_litgpt", "hybrid_litgpt",
                 *(["pp_llama", "tp_llama", "fsdp2_litgpt"] if FULL_MATRIX else [])]  # fmt: skip
STRATEGY_RUNS = [*TRAINING_RUNS, "resume_llama", "restart_llama", "ours_llama"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scenarios.models import save_litgpt_folder, tiny_hf_causal_lm

    root = tmp_path_factory.mktemp("pretrained_strategies")
    torch.manual_seed(0)
    tiny_hf_causal_lm("llama").to(torch.bfloat16).save_pretrained(root / "llama", max_shard_size="20KB")
    shutil.copytree(root / "llama", root / "restart_weights")  # the restart recipe's, moved away between launches
    tiny_hf_causal_lm("gpt2").save_pretrained(root / "gpt2", max_shard_size="20KB")
    tiny_hf_causal_lm("mixtral").to(torch.bfloat16).save_pretrained(root / "mixtral", max_shard_size="30KB")
    save_litgpt_folder(root / "litgpt")
    return root


def _one_process_run(folder: Path) -> tuple[list[float], torch.Tensor]:
    """One process that loaded the weights as their library does (``from_pretrained`` in fp64; litgpt's
    ``load_state_dict``), on the global batch of every step: its losses, and its logits on :data:`PROBE` after
    training."""
    from scenarios.common import SEQ_LEN, OneProcessData, StepRecorder, trainer_kwargs
    from scenarios.models import PretrainedCausalLM, PretrainedLitGPT

    L.seed_everything(1234, verbose=False)
    data = OneProcessData(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH, train_samples=64, val_samples=4)
    steps = StepRecorder()
    trainer = L.Trainer(**trainer_kwargs(1, strategy="auto", precision="64-true", limit_val_batches=0),
                        max_steps=STEPS, callbacks=[steps])  # fmt: skip
    module = (PretrainedLitGPT if folder.name == "litgpt" else PretrainedCausalLM)(str(folder), from_pretrained=True)
    trainer.fit(module, data)
    os.environ.pop("PL_GLOBAL_SEED", None)
    with torch.no_grad():
        return steps.losses, _logits(module.model)


def _implementations(kind: str) -> dict[str, str]:
    """The experts as a loop, as the reference runs them (grouped_mm, transformers' CPU default, takes no fp64)."""
    return {"experts_implementation": "eager"} if kind == "mixtral" else {}


PROBE = torch.arange(16).reshape(2, 8) % 64


def _logits(model: torch.nn.Module) -> torch.Tensor:
    out = (
        model(PROBE)
        if not hasattr(model, "config") or not hasattr(model.config, "model_type")
        else model(input_ids=PROBE).logits
    )
    return out.detach().to(torch.float64)


@pytest.fixture(scope="module")
def runs(folders: Path) -> dict:
    return run_scenarios("pretrained_strategy_runs.py", 4, folders, STRATEGY_RUNS, timeout=900)


@pytest.fixture(scope="module")
def references(folders: Path) -> dict[str, tuple[list[float], torch.Tensor]]:
    return {kind: _one_process_run(folders / kind) for kind in ("llama", "gpt2", "mixtral", "litgpt")}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", TRAINING_RUNS)
def test_every_strategy_starts_from_the_files_values_and_trains_as_from_pretrained(runs, references, scenario):
    run = runs[scenario]
    assert run["differ"] == [] and run["compared"] > 0, run["differ"]
    assert len(run["log"]) == 1 and "initial_weights:" in run["log"][0] and "loaded into model" in run["log"][0]
    reference, _ = references[scenario.split("_")[1]]
    assert len(run["losses"]) == len(reference) == STEPS
    gap = max(abs(a - b) for a, b in zip(run["losses"], reference))
    assert gap <= FP64_TOL, (run["losses"], reference)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", TRAINING_RUNS)
def test_the_trained_checkpoint_exports_to_what_its_library_loads_strictly(runs, references, scenario, tmp_path):
    """``export`` of each run's (sharded) checkpoint: Hugging Face models load strictly with ``from_pretrained``,
    litgpt's with ``load_state_dict(strict=True)``, and give the logits of the one-process model trained alike."""
    import transformers

    from lightning_dist.checkpoint.export import export_checkpoint

    kind = scenario.split("_")[1]
    if kind == "litgpt":
        from litgpt.config import Config
        from litgpt.model import GPT

        export_checkpoint(runs[scenario]["checkpoint"], tmp_path / "out", format="litgpt")
        model = GPT(Config.from_file(tmp_path / "out" / "model_config.yaml")).to(torch.float64)
        model.load_state_dict(torch.load(tmp_path / "out" / "lit_model.pth", weights_only=True), strict=True)
    else:
        export_checkpoint(runs[scenario]["checkpoint"], tmp_path / "out", format="hf", max_shard_size="40KB")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "out", dtype=torch.float64, output_loading_info=True, **_implementations(kind)
        )
        assert not any(info.values()), info  # no missing, unexpected or mismatched key
    with torch.no_grad():
        logits = _logits(model.eval())
    # the bar is 1e-5 (fp32); measured in fp64 against the one-process model: HF ≤ 1e-9, litgpt 4.1e-8
    gap = float((logits - references[kind][1]).abs().max())
    assert gap <= 1e-6, gap


@pytest.mark.slow
def test_a_resumed_fit_takes_the_checkpoint_not_initial_weights(runs):
    run = runs["resume_llama"]
    assert len(run["log"]) == 1 and run["log"][0].endswith("/llama' not read: resuming from ckpt_path"), run["log"]
    assert run["differ"], "the fit started from the file's values, not from the checkpoint"
    assert run["saved_step"] == STEPS and run["losses"] == []  # resumed at its step: nothing left to train


@pytest.mark.slow
def test_the_restart_recipe_reads_the_weights_on_its_first_launch_and_resumes_on_the_second(runs, references):
    """``initial_weights`` with ``ckpt_path="last"`` in one configuration: the first launch has no ``last``
    checkpoint, loads the folder (its tensors equal to the file's right after the load) and trains 2 steps; the
    second, with the folder moved away, resumes from ``last`` without reading it and trains the third. Together they
    give the losses of one process that called ``from_pretrained`` (fp64)."""
    run = runs["restart_llama"]
    first, second = run["first"], run["second"]
    assert first["differ"] == [] and first["compared"] > 0, first["differ"]
    assert len(first["log"]) == 1 and "restart_weights' loaded into model" in first["log"][0], first["log"]
    assert len(second["log"]) == 1 and second["log"][0].endswith("restart_weights' not read: resuming from ckpt_path")
    assert second["differ"], "the second launch started from the file's values, not from `last`"
    assert not run["weights_left"]  # the folder really was away while the second launch ran
    reference, _ = references["llama"]
    losses = first["losses"] + second["losses"]
    assert len(first["losses"]) == STEPS - 1 and len(losses) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= FP64_TOL, (losses, reference)


@pytest.mark.slow
def test_one_of_our_checkpoints_gives_its_weights_under_another_strategy(runs):
    run = runs["ours_llama"]
    assert run["differ"] == [] and run["compared"] > 0, run["differ"]
    assert len(run["log"]) == 1 and "the model weights of the checkpoint" in run["log"][0], run["log"]
    assert "no optimizer or loop state" in run["log"][0] and len(run["losses"]) == STEPS


# ------------------------------------------------------------------------------------------ before launch, one process
def _refused_before_launch(folder: Path, module: L.LightningModule, tmp_path: Path) -> str:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(initial_weights=str(folder)),
                        max_steps=1, logger=False, enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(CheckpointError) as info:
        trainer.fit(module)
    assert not tmp_path.exists(), "a refused run wrote something"
    return str(info.value)


def test_another_models_folder_is_refused_before_launch(folders, tmp_path):
    from scenarios.models import PretrainedCausalLM

    with torch.device("meta"):
        module = PretrainedCausalLM(str(folders / "llama"))
    message = _refused_before_launch(folders / "gpt2", module, tmp_path / "run")
    assert "none of the file's keys is a parameter name of the model" in message


def test_a_missing_shard_is_refused_before_launch(folders, tmp_path):
    from scenarios.models import PretrainedCausalLM

    folder = tmp_path / "llama"
    shutil.copytree(folders / "llama", folder)
    (folder / "model-00003-of-00003.safetensors").unlink()
    with torch.device("meta"):
        module = PretrainedCausalLM(str(folder))
    message = _refused_before_launch(folder, module, tmp_path / "run")
    assert "model-00003-of-00003.safetensors" in message and "Was the download interrupted?" in message


def test_a_wrong_dtype_or_shape_is_refused_before_launch(folders, tmp_path):
    from safetensors.torch import load_file, save_file
    from scenarios.models import PretrainedCausalLM

    tensors = {k: v for f in sorted((folders / "llama").glob("*.safetensors")) for k, v in load_file(f).items()}
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.int16)
    tensors["model.norm.weight"] = torch.ones(31, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    with torch.device("meta"):
        module = PretrainedCausalLM(str(folders / "llama"))
    message = _refused_before_launch(tmp_path / "model.safetensors", module, tmp_path / "run")
    assert "model.norm.weight (file [31], model [32])" in message
    assert "lm_head.weight (file torch.int16, model torch.bfloat16)" in message


def test_initial_weights_must_be_a_path():
    with pytest.raises(TypeError, match="initial_weights=3: expected the path"):
        FSDP2Strategy(initial_weights=3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ LightningCLI, one process
@pytest.mark.parametrize("initial_weights", [True, False])
def test_lightning_dist_fit_builds_the_model_on_the_meta_device_when_initial_weights_is_set(
    folders, tmp_path, initial_weights
):
    """The YAML of ``lightning-dist fit``: with ``initial_weights`` the model is built on the meta device (the user
    writes nothing); without it, as before."""
    import yaml

    from lightning_dist.lightning_cli import CLI_CLASSES, DistCLI

    init_args = {"initial_weights": str(folders / "llama")} if initial_weights else {}
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "default_root_dir": str(tmp_path),
                    "strategy": {"class_path": "lightning_dist.FSDP2Strategy", "init_args": init_args}},
        "model": {"class_path": "scenarios.models.PretrainedCausalLM", "init_args": {"folder": str(folders / "llama")}},
    }  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    cli = DistCLI(**CLI_CLASSES, args=["--config", str(tmp_path / "config.yaml")], run=False)
    devices = {p.device.type for p in cli.model.parameters()}
    assert devices == ({"meta"} if initial_weights else {"cpu"})
    assert (cli.trainer.strategy.initial_weights is not None) == initial_weights
