"""Hugging Face models as users build them (issue 39, items 7 and 8).

Meta-device init: a stock transformers model built under ``trainer.init_module(empty_init=True)`` starts as one
process's would: what its constructor computes (norm weights, the rotary ``inv_freq``, padding rows, tied weights)
exactly, random draws with the same spread; with a normal build's weights loaded, the same first loss (fp64, 1e-10).
Before materialization ran the model's own init, norms and ``inv_freq`` held whatever memory held (NaN in GPT-2's
``Conv1D`` bias and tensor parallel's final norm; Llama's first loss 1.4e-5 off), and on the CPU both ranks' halves
of every sharded weight were the same numbers. A first loss that is not finite is reported on every ``on_nonfinite``
setting.

The key/value cache: strategies turn ``use_cache`` off while a training step runs (evaluation keeps the user's
setting), so a default-config Llama compiles the graphs of ``use_cache=False`` (1 graph of 41 operations per step
here, against 2 of 45 before).

One launch of 2 processes runs every multi-process scenario (``tests/scenarios/hf_init_runs.py``).
"""

from __future__ import annotations

import pytest
import torch
from launch import run_scenarios
from torch import nn

from lightning_dist.compat.hugging_face import generation_cache_configs, generation_cache_off
from lightning_dist.parallel.materialize import materialize, never_initialized_buffers

FP64_TOL = 1e-10
EMPTY_INIT_RUNS = ["empty_init_llama", "empty_init_gpt2", "empty_init_qwen3", "empty_init_mixtral", "tp_llama",
                   "pp_llama"]  # fmt: skip
OWN_INIT = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM",
            "mixtral": "MixtralForCausalLM"}  # fmt: skip


# ---------------------------------------------------------------------------------------------- one process (fast)
def _tiny(kind: str) -> nn.Module:
    from tests.scenarios.models import tiny_hf_causal_lm

    return tiny_hf_causal_lm(kind)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen3", "mixtral"])
def test_a_meta_device_hugging_face_model_is_initialized_as_its_constructor_would(kind):
    torch.manual_seed(0)
    reference = _tiny(kind)
    with torch.device("meta"):
        model = _tiny(kind)
    materialized = materialize(model, torch.device("cpu"))
    assert materialized is not None and materialized.pretrained == (OWN_INIT[kind],)
    assert materialized.uninitialized == materialized.lost_buffers == ()
    params, buffers = dict(reference.named_parameters()), dict(reference.named_buffers())
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        if param.dim() == 1:  # norm weights and biases: values, not draws
            assert torch.equal(param, params[name]), name
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name  # the rotary inv_freq
    pad = model.config.pad_token_id
    if pad is not None:
        assert not model.get_input_embeddings().weight[pad].any()
    tied = reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(input_ids=tokens).logits, reference(input_ids=tokens).logits)


class _Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


class _Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


class _ResetsItsOwnOnly(nn.Module):
    """A module whose ``reset_parameters`` initializes its own weight, not its child's buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.table = _Table()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def test_state_nothing_initializes_is_nan_and_named():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Gain(), _ResetsItsOwnOnly())
    # Before launch only what surely nothing sets is refused: a reset_parameters() above a buffer might set it.
    assert never_initialized_buffers(model) == {}
    assert never_initialized_buffers(nn.Sequential(_Table()).to("meta")) == {"0.inv_freq": "_Table"}
    materialized = materialize(model, torch.device("cpu"))
    assert materialized is not None and materialized.reset_modules == 2
    assert materialized.uninitialized == ("1.gain",) and materialized.lost_buffers == ("2.table.inv_freq",)
    assert materialized.classes == {"1.gain": "_Gain", "2.table.inv_freq": "_Table"}
    assert torch.isnan(model[1].gain).all() and torch.isfinite(model[0].weight).all()
    assert materialize(model, torch.device("cpu")) is None  # nothing left on the meta device


def test_the_generation_cache_is_off_only_within_the_context():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = nn.ModuleDict({"a": _tiny("llama"), "b": GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2))})
    model["b"].config.use_cache = False
    configs = generation_cache_configs(model)
    assert configs == [model["a"].config]  # once, though LlamaForCausalLM and its LlamaModel share it
    with pytest.raises(RuntimeError), generation_cache_off(configs):
        assert model["a"].config.use_cache is False
        raise RuntimeError
    assert model["a"].config.use_cache is True and model["b"].config.use_cache is False


# ---------------------------------------------------------------------------------------------- 2 processes (slow)
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    scenarios = [*EMPTY_INIT_RUNS, "compile_default", "compile_no_cache", "first_loss_ignore", "first_loss_skip",
                 "first_loss_stop"]  # fmt: skip
    return run_scenarios("hf_init_runs.py", 2, tmp_path_factory.mktemp("hf_init"), scenarios)


@pytest.mark.slow
@pytest.mark.parametrize("name", EMPTY_INIT_RUNS)
def test_empty_init_hugging_face_models_start_as_one_process(runs, name):
    """fsdp2 (Llama, GPT-2, Qwen3, Mixtral), tensor_parallel and pipeline (Llama), each rank materializing its
    shards or its stage."""
    run = runs[name]
    assert run["nan"] == [] and run["warnings"] == []
    assert run["norms_one"] and all(run["norms_one"])
    if "gpt2" not in name:
        assert run["inv_freq_equal"] and all(run["inv_freq_equal"].values()), run["inv_freq_equal"]
    assert all(0.8 < spread < 1.25 for spread in run["spread"].values()), run["spread"]  # std over a normal build's
    assert run["embedding_halves_differ"]  # each rank drew its own shard
    assert run.get("padding_row") in (None, 0.0)
    assert run.get("tied", "gpt2" in name) == ("gpt2" in name)
    kind = name.split("_")[-1]
    assert any(f"then the own weight init of {OWN_INIT[kind]} (transformers)" in line for line in run["log"])
    assert len(run["losses"]) == 1 and abs(run["losses"][0] - run["reference_losses"][0]) <= FP64_TOL


CACHE_LINE = (
    "fsdp2: key/value cache off in training steps (use_cache=False on LlamaConfig while a training step runs, as"
    " transformers' Trainer does); validation, test and predict keep use_cache=True"
)


@pytest.mark.slow
def test_the_kv_cache_is_off_in_training_steps_only(runs):
    for name in EMPTY_INIT_RUNS:
        assert runs[name]["use_cache_seen"] == {"train": [False], "val": [True]}, name
    default, no_cache = runs["compile_default"], runs["compile_no_cache"]
    # one graph per step (41 operations with torch 2.13, transformers 5.24), as with use_cache=False; before: 2 of 45
    assert default["graphs"] == no_cache["graphs"] and len(no_cache["graphs"]) == 1, (default, no_cache)
    assert default["log"] == [CACHE_LINE]
    assert no_cache["log"] == []


FIRST_STEP = "at global step 0 (epoch 0, batch 0): a non-finite loss on rank 0, 1"


@pytest.mark.slow
def test_a_non_finite_first_loss_is_reported_on_every_setting(runs):
    """A model whose ``Gain`` has no ``reset_parameters`` (built under empty_init): materializing says so, and the
    first loss, NaN, is reported by every ``on_nonfinite`` setting."""
    for mode in ("ignore", "skip", "stop"):
        run = runs[f"first_loss_{mode}"]
        assert run["warnings"][0].startswith("Trainer.init_module(empty_init=True): gain.gain (Gain) have no values")
        if mode == "stop":
            assert run["error"].startswith(f"Training stopped at the first training step, {FIRST_STEP}")
            assert run["global_step"] == 0
            continue
        first = [w for w in run["warnings"] if w.startswith("The first training loss is not finite")]
        assert len(first) == 1 and first[0].startswith(f"The first training loss is not finite, {FIRST_STEP}.")
        assert ("Its optimizer step is skipped" if mode == "skip" else "Training goes on") in first[0]
        assert run["error"] is None and run["global_step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["empty_init_llama", "tp_llama", "pp_llama"])
def test_two_process_checkpoints_export_to_a_hugging_face_folder(runs, name, tmp_path):
    """Issue 42: the sharded folders of 2-rank fsdp2, tensor_parallel and pipeline runs export as ≥ 3 shards that
    ``from_pretrained`` loads strictly, with the logits of the trained weights (fp64)."""
    from transformers import AutoModelForCausalLM

    from lightning_dist.checkpoint.consolidate import load_full_checkpoint
    from lightning_dist.checkpoint.export import export_checkpoint

    checkpoint = runs[name]["checkpoint"]
    report = export_checkpoint(checkpoint, tmp_path / "hf", max_shard_size="40KB")
    shards = [f for f in report.files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and "model.safetensors.index.json" in report.files
    assert report.peak_tensor_bytes <= 40_000 < report.total_bytes
    exported, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf",
        output_loading_info=True,
        attn_implementation="eager",  # the trained model's (fp32 softmax)
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert exported.dtype == torch.float64  # config.json's dtype is the trained weights'
    trained = _tiny("llama").double()
    trained.load_state_dict({k[len("model.") :]: v for k, v in load_full_checkpoint(checkpoint)["state_dict"].items()})
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(exported(tokens).logits, trained(tokens).logits, atol=1e-12, rtol=0)
