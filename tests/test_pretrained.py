"""Pretrained safetensors weights in (issue 42, the loading side): :func:`load_pretrained`.

A stock ``LlamaForCausalLM`` saved by ``save_pretrained`` in bf16 into 3 shards loads into a model built from its
config exactly as ``from_pretrained(..., dtype=torch.float32)`` does (the file's values, converted); the pretrained
model is found at any prefix of the module that holds it; tied GPT-2 weights are loaded once and stay tied; files that
do not fit are refused, naming what differs, before any tensor is read. One launch of 2 processes
(``tests/scenarios/pretrained_runs.py``) loads both into fsdp2-sharded models built on the meta device: the full
tensors equal the file's, and 3 AdamW steps in fp64 equal one process that called ``from_pretrained`` (≤ 1e-10).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_scenarios
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_dist.checkpoint import CheckpointError
from lightning_dist.checkpoint.pretrained import load_pretrained, read_pretrained_files

FP64_TOL = 1e-10
SHARD_SIZE = "20KB"  # the tiny Llama in bf16 (~41 KB) in 3 shards


def tiny_llama(**overrides: object) -> nn.Module:
    import transformers as tf

    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16}  # fmt: skip
    config = tf.LlamaConfig(**{**sizes, **overrides}, attn_implementation="eager", bos_token_id=0, eos_token_id=1,
                            tie_word_embeddings=False)  # fmt: skip
    return tf.LlamaForCausalLM(config)


def tiny_gpt2() -> nn.Module:
    import transformers as tf

    config = tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0,
                           eos_token_id=1)  # fmt: skip
    return tf.GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``llama``: a bf16 Llama in 3 shards with its index; ``gpt2``: a tied GPT-2 in fp32, sharded too."""
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    tiny_llama().to(torch.bfloat16).save_pretrained(root / "llama", max_shard_size=SHARD_SIZE)
    tiny_gpt2().save_pretrained(root / "gpt2", max_shard_size=SHARD_SIZE)
    return root


class Wrapper(nn.Module):
    """The pretrained model two levels down, beside a new head of its own (left as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Module()
        self.net.model = tiny_llama()
        self.head = nn.Linear(32, 2)


def _file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for file in sorted(folder.glob("*.safetensors")) for k, v in load_file(file).items()}


# ---------------------------------------------------------------------------------------------- one process (fast)
def test_the_files_keys_shapes_and_dtypes_come_from_the_headers(folders):
    files = read_pretrained_files(folders / "llama")
    assert len(files.files) >= 3
    held = _file_tensors(folders / "llama")
    assert {k: (tuple(v.shape), v.dtype) for k, v in held.items()} == {
        k: (t.shape, t.dtype) for k, t in files.tensors.items()
    }


def test_a_sharded_bf16_folder_loads_as_from_pretrained_does(folders):
    from transformers import LlamaForCausalLM

    model = tiny_llama()
    report = load_pretrained(model, folders / "llama")
    assert report.prefix == "" and report.loaded == len(_file_tensors(folders / "llama"))
    reference = LlamaForCausalLM.from_pretrained(folders / "llama", dtype=torch.float32)
    state = model.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    for name, value in _file_tensors(folders / "llama").items():
        assert torch.equal(state[name], value.float()), name


def test_reads_in_threads_load_the_same_values_within_the_largest_reads_bytes(folders, monkeypatch):
    """4 threads read the tensors of a sharded folder: the same values as one thread, never more bytes in flight
    than the largest single read (the memory bound of one serial read), and reads did overlap."""
    from lightning_dist.checkpoint.pretrained import load as loading

    in_flight: list[tuple[int, int, int]] = []  # bytes in flight once a read is admitted, its own bytes, the limit
    acquire = loading._ByteBudget.acquire

    def recorded(self: Any, size: int) -> None:
        acquire(self, size)
        in_flight.append((self.in_flight, size, self.limit))

    monkeypatch.setattr(loading._ByteBudget, "acquire", recorded)
    serial, threaded = tiny_llama(), tiny_llama()
    load_pretrained(serial, folders / "llama", threads=1)
    load_pretrained(threaded, folders / "llama", threads=4)
    assert all(torch.equal(a, b) for a, b in zip(serial.state_dict().values(), threaded.state_dict().values()))
    assert in_flight and all(used <= limit for used, _, limit in in_flight)
    assert any(used > size for used, size, _ in in_flight)  # another read was in flight


def test_the_pretrained_model_is_found_under_a_prefix_and_the_rest_is_left_alone(folders):
    module = Wrapper()
    head = module.head.weight.detach().clone()
    report = load_pretrained(module, folders / "llama")
    assert report.prefix == "net.model."
    assert report.outside_prefix == ("head.weight", "head.bias")
    assert torch.equal(module.head.weight, head)
    file = _file_tensors(folders / "llama")
    assert torch.equal(module.net.model.lm_head.weight, file["lm_head.weight"].float())


def test_a_single_safetensors_file_and_an_explicit_prefix(folders, tmp_path):
    from safetensors.torch import save_file

    save_file(_file_tensors(folders / "llama"), tmp_path / "weights.safetensors")
    module = Wrapper()
    report = load_pretrained(module, tmp_path / "weights.safetensors", prefix="net.model")
    assert report.prefix == "net.model." and report.loaded == len(_file_tensors(folders / "llama"))


def test_files_beside_the_index_that_it_does_not_name_are_not_read(folders, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(folders / "llama", folder)
    (folder / "consolidated.safetensors").write_bytes(b"not read")
    model = tiny_llama()
    load_pretrained(model, folder)
    assert torch.equal(model.lm_head.weight, _file_tensors(folders / "llama")["lm_head.weight"].float())


def test_tied_weights_are_loaded_once_and_stay_tied(folders):
    model = tiny_gpt2()
    report = load_pretrained(model, folders / "gpt2")
    assert "lm_head.weight" not in read_pretrained_files(folders / "gpt2").tensors
    assert report.tied == {"transformer.wte.weight": ("lm_head.weight",)}
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, _file_tensors(folders / "gpt2")["transformer.wte.weight"])


def test_non_persistent_buffers_are_not_expected_in_the_file(folders):
    model = tiny_llama()
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    load_pretrained(model, folders / "llama")
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)


# ------------------------------------------------------------------------------------------------ refusals, one process
def _refusal(model: nn.Module, path: Path, **kwargs: object) -> str:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_pretrained(model, path, **kwargs)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed the model"
    return str(info.value)


def test_a_folder_from_another_model_is_refused(folders):
    message = _refusal(tiny_llama(), folders / "gpt2")
    assert "none of the file's keys is a parameter name of the model" in message
    assert "transformer.h.0" in message and "model.layers.0" in message


def test_a_missing_shard_is_refused_before_anything_loads(folders, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(folders / "llama", folder)
    (folder / "model-00002-of-00003.safetensors").unlink()
    message = _refusal(tiny_llama(), folder)
    assert "1 of the 3 shards its model.safetensors.index.json names are not there" in message
    assert "model-00002-of-00003.safetensors" in message and "download" in message


def test_shape_mismatches_name_both_shapes(folders):
    message = _refusal(tiny_llama(intermediate_size=48), folders / "llama")
    assert "6 shapes differ" in message
    assert "model.layers.0.mlp.gate_proj.weight (file [64, 32], model [48, 32])" in message


def test_keys_the_model_lacks_and_state_the_file_leaves_unloaded_are_listed(folders):
    message = _refusal(tiny_llama(num_hidden_layers=1), folders / "llama")
    assert "9 keys of the file are not in the model: model.layers.1." in message
    message = _refusal(tiny_llama(num_hidden_layers=3), folders / "llama")
    assert "9 parameters or buffers of the model are not in the file: model.layers.2." in message


def test_a_persistent_buffer_the_file_lacks_is_refused(folders):
    model = tiny_llama()
    model.model.register_buffer("scale", torch.ones(2))
    assert "not in the file: model.scale" in _refusal(model, folders / "llama")


def test_a_dtype_that_cannot_be_converted_is_refused(folders, tmp_path):
    from safetensors.torch import save_file

    tensors = _file_tensors(folders / "llama")
    tensors["lm_head.weight"] = torch.zeros(64, 32, dtype=torch.int32)
    save_file(tensors, tmp_path / "model.safetensors")
    message = _refusal(tiny_llama(), tmp_path)
    assert "lm_head.weight (file torch.int32, model torch.float32)" in message


def test_a_meta_device_model_is_refused(folders):
    with torch.device("meta"):
        model = tiny_llama()
    with pytest.raises(CheckpointError, match="still on the meta device .materialize the model first."):
        load_pretrained(model, folders / "llama")


def test_two_equally_fitting_submodules_are_refused(folders):
    module = nn.Module()
    module.student, module.teacher = tiny_llama(), tiny_llama()
    message = _refusal(module, folders / "llama")
    assert "'student.', 'teacher.'" in message and "pass the prefix" in message


def test_a_damaged_index_or_a_folder_without_weights_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors file"):
        read_pretrained_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../x.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside the folder"):
        read_pretrained_files(tmp_path)


# ------------------------------------------------------------------------------------------- fsdp2, 2 processes (slow)
@pytest.fixture(scope="module")
def fsdp2_runs(folders: Path) -> dict:
    return run_scenarios("pretrained_runs.py", 2, folders, ["fsdp2_llama", "fsdp2_gpt2_tied"])


@pytest.mark.slow
def test_fsdp2_shards_load_the_files_values_and_train_as_from_pretrained(fsdp2_runs):
    run = fsdp2_runs["fsdp2_llama"]
    assert run["prefix"] == "" and run["dtypes"] == ["torch.bfloat16"]
    assert run["compared"] == run["loaded"] and run["differ"] == []
    assert run["inv_freq_equal"]
    assert sum(run["elements_read"]) == run["elements_in_file"], run["elements_read"]  # each slice read once
    assert max(run["elements_read"]) == run["elements_in_file"] // 2  # dim-0 halves: every shape divides by 2
    assert run["loss_diff"] <= FP64_TOL and run["param_diff"] <= FP64_TOL, run
    assert fsdp2_runs["lightning_imported"] is False


@pytest.mark.slow
def test_fsdp2_tied_gpt2_weights_stay_tied(fsdp2_runs):
    run = fsdp2_runs["fsdp2_gpt2_tied"]
    assert run["same_tensor"] and not run["head_in_file"]
    assert run["tied"] == {"transformer.wte.weight": ["lm_head.weight"]}
    assert run["differ"] == []


# --------------------------------------------------------------------------- stacked experts (transformers 5 MoE), one process
def test_a_mixtrals_per_expert_file_loads_into_its_stacked_experts(tmp_path):
    import transformers as tf
    from scenarios.models import tiny_hf_causal_lm

    torch.manual_seed(0)
    tiny_hf_causal_lm("mixtral").to(torch.bfloat16).save_pretrained(tmp_path / "mixtral", max_shard_size="30KB")
    keys = set(read_pretrained_files(tmp_path / "mixtral").tensors)
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in keys  # what save_pretrained writes
    reference = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "mixtral", dtype=torch.float32).state_dict()
    model = tf.AutoModelForCausalLM.from_config(
        tf.AutoConfig.from_pretrained(tmp_path / "mixtral"), dtype=torch.float32
    )
    load_pretrained(model, tmp_path / "mixtral")
    state = model.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 32)
    assert [k for k in reference if not torch.equal(state[k], reference[k])] == []

    files = {k: v for f in sorted((tmp_path / "mixtral").glob("*.safetensors")) for k, v in load_file(f).items()}
    del files["model.layers.1.block_sparse_moe.experts.2.w1.weight"]
    save_file(files, tmp_path / "one_expert_short.safetensors")
    message = _refusal(model, tmp_path / "one_expert_short.safetensors")
    assert "not in the file: model.layers.1.mlp.experts.gate_up_proj" in message
    assert "keys of the file are not in the model: model.layers.1.block_sparse_moe.experts.0.w1.weight" in message


def test_a_base_models_weights_in_a_module_with_a_head_warn_naming_the_head(tmp_path):
    """A base ``LlamaModel``'s folder as ``initial_weights`` of a causal-LM module: 20 of 21 tensors load and
    ``lm_head.weight`` keeps its random init; the fit warns once, before the first step, naming it."""
    import warnings

    import lightning as L

    from examples.data import TextDataModule
    from lightning_dist import FSDP2Strategy
    from tests.scenarios.models import PretrainedCausalLM, tiny_hf_causal_lm

    torch.manual_seed(0)
    lm = tiny_hf_causal_lm("llama")
    lm.model.save_pretrained(tmp_path / "base")
    lm.config.save_pretrained(tmp_path / "base")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(initial_weights=str(tmp_path / "base")),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    with trainer.init_module(empty_init=True):
        module = PretrainedCausalLM(str(tmp_path / "base"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, TextDataModule(seq_len=16, batch_size=2, train_samples=8, val_samples=2))
    left = [str(w.message) for w in caught if "keep their own initialization" in str(w.message)]
    assert len(left) == 1 and "1 parameters or buffers" in left[0] and ": model.lm_head.weight." in left[0], left
