"""The ``float8`` option (FP8 training through torchao, emulated on the CPU): the option and its checks, which layers
are converted, and real runs under fsdp2, tensor_parallel, pipeline, context_parallel and hybrid3d against runs
without float8.

Tolerance: FP8 rounds each matmul input to 3 mantissa bits (e4m3), so an FP8 run is not an fp32 run. Over 6 AdamW
steps of the example GPT (d_model 32, 2 blocks, lr 1e-2 after 2 warm-up steps) the losses stayed within 2.1e-3 of
fsdp2's run without float8 (measured: fsdp2 rowwise 2.1e-3, tensorwise 1.0e-3, tensor_parallel 1.9e-3, hybrid3d
pp2×tp2 1.9e-3, context_parallel cp=2 1.6e-3; a bf16 pipeline resumed with FP8: 1.7e-3 from the uninterrupted bf16 run). Strategies other than
fsdp2 are compared with fsdp2's fp32 run: without float8 they match one process to 1e-4 (the parity tests), far inside
the bound. The bound is 1e-2, the issue's expectation (~1e-2 over 6 steps; its holdout GPT with dims 64/256 measured
7.4e-3 rowwise). Every FP8 run must also differ from its reference (> 0): a run that converted nothing would not.
The stock transformers Llama has its own bound, stated at its test.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from launch import FULL_MATRIX, max_abs_diff, run_scenarios

from examples.gpt import GPT
from lightning_dist import FSDP2Strategy, PipelineStrategy, TensorParallelStrategy
from lightning_dist.checkpoint.consolidate import load_full_checkpoint
from lightning_dist.compat.torchao import is_float8_linear
from lightning_dist.parallel.float8 import (
    Float8Settings,
    check_float8_recipe,
    check_float8_skip,
    convert_to_float8,
    float8_choice,
    float8_emulation,
)

FP8_TOL = 1e-2
SCRIPT = "float8_runs.py"
BLOCK_LINEARS = [f"blocks.{i}.{m}" for i in range(2) for m in ("attn.key", "attn.proj", "attn.query", "attn.value")]
LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")  # fmt: skip
BLOCK_LINEARS = sorted(BLOCK_LINEARS + [f"blocks.{i}.mlp.{m}" for i in range(2) for m in ("down", "up")])


# ---------------------------------------------------------------------------------------------- the option (fast)
@pytest.mark.parametrize("cls", [FSDP2Strategy, TensorParallelStrategy, PipelineStrategy])
def test_every_strategy_takes_float8_and_float8_skip(cls):
    strategy = cls(float8="rowwise", float8_skip=["blocks\\.0\\..*", "head"])
    assert strategy.float8 == "rowwise" and strategy.float8_skip == ("blocks\\.0\\..*", "head")
    assert cls().float8 is None and cls().float8_skip == ()


def test_unknown_recipe_and_bad_skip_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"float8='fp8' is not a float8 recipe. Use one of \['rowwise'"):
        FSDP2Strategy(float8="fp8")
    with pytest.raises(ValueError, match=r"float8_skip: '\(' is not a valid regex"):
        check_float8_skip("(")
    with pytest.raises(TypeError, match="float8_skip=3"):
        check_float8_skip(3)
    assert check_float8_recipe(None) is None


def test_hardware_emulates_on_cpu_and_refuses_old_gpus():
    assert float8_emulation("rowwise", "cpu", None) is True
    assert float8_emulation("mxfp8", "cpu", None) is True
    assert float8_emulation("tensorwise", "cuda", (9, 0)) is False
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer .* this GPU is 8.0"):
        float8_emulation("rowwise", "cuda", (8, 0))
    with pytest.raises(ValueError, match=r"float8='mxfp8' .* 10.0 or newer \(B200 or newer\); this GPU is 9.0"):
        float8_emulation("mxfp8", "cuda", (9, 0))


def test_the_choice_skips_the_head_the_skip_patterns_and_odd_dims():
    model = GPT(vocab_size=64, d_model=32, n_layer=2, n_head=4)
    model.blocks[1].mlp.up = torch.nn.Linear(32, 120)  # 120 is not a multiple of 16
    settings = Float8Settings("rowwise", skip=(r"blocks\.0\.attn\..*",), head="head")
    converted, skipped = float8_choice(model, settings)
    assert skipped == {
        "blocks.0.attn.query": "float8_skip 'blocks\\\\.0\\\\.attn\\\\..*'",
        "blocks.0.attn.key": "float8_skip 'blocks\\\\.0\\\\.attn\\\\..*'",
        "blocks.0.attn.value": "float8_skip 'blocks\\\\.0\\\\.attn\\\\..*'",
        "blocks.0.attn.proj": "float8_skip 'blocks\\\\.0\\\\.attn\\\\..*'",
        "blocks.1.mlp.up": "32×120 not multiples of 16",
        "head": "output head",
    }
    assert converted == [
        "blocks.0.mlp.up",
        "blocks.0.mlp.down",
        *[f"blocks.1.attn.{n}" for n in ["query", "key", "value", "proj"]],
        "blocks.1.mlp.down",
    ]


def test_mxfp8_emulated_converts_the_linears_without_bias_and_trains_on_cpu():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, d_model=32, n_layer=1, n_head=4)
    reference = GPT(vocab_size=64, d_model=32, n_layer=1, n_head=4)
    reference.load_state_dict(model.state_dict())
    record = convert_to_float8(model, Float8Settings("mxfp8", emulate=True, head="head"))
    assert record.converted == [f"blocks.0.attn.{n}" for n in ("query", "key", "value", "proj")]
    dropped = "has a bias, which torchao 0.18's MXFP8 linear leaves out of its output"
    assert record.skipped == {"blocks.0.mlp.up": dropped, "blocks.0.mlp.down": dropped, "head": "output head"}
    assert all(is_float8_linear(model.get_submodule(n)) for n in record.converted)
    ids = torch.randint(0, 64, (2, 32))  # MX scales blocks of 32 tokens in backward
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    expected = torch.nn.functional.cross_entropy(reference(ids).flatten(0, 1), ids.flatten())
    assert abs(loss.item() - expected.item()) < 1e-2  # the biases are still there
    assert all(p.grad is not None for n, p in model.named_parameters() if "blocks" in n)


def test_float8_without_torchao_names_the_install_line(monkeypatch):
    import lightning_dist.strategies.lifecycle.float8 as setup

    monkeypatch.setattr(setup, "torchao_version", lambda: None)  # as on a machine without torchao
    trainer = L.Trainer(strategy=FSDP2Strategy(float8="rowwise"), accelerator="cpu", devices=2, logger=False)
    with pytest.raises(
        ModuleNotFoundError, match=r"float8='rowwise' needs torchao.*pip install 'lightning-dist\[fp8\]'"
    ):
        trainer.strategy.check_float8()


def test_tensorwise_with_an_int_reshard_after_forward_is_refused_before_launch(tmp_path):
    model = GPT(vocab_size=64, d_model=32, n_layer=2, n_head=4)
    strategy = FSDP2Strategy(float8="tensorwise", reshard_after_forward=2)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=4, logger=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"float8='tensorwise' .* int reshard_after_forward=2 .* float8='rowwise'"):
        trainer.fit(model)
    assert not torch.distributed.is_initialized()


# ---------------------------------------------------------------------------------------------- real runs (slow)
@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("float8")
    return run_scenarios(SCRIPT, 2, workdir, ["fsdp2", "tensor_parallel", "pipeline", "context_parallel", "llama"])


def _check_fp8_run(run: dict, reference: dict) -> None:
    """``run`` converted every block linear it holds, logged it, kept fp32 state, and stayed within the tolerance of
    ``reference`` (fsdp2's fp32 run: every strategy matches one process to 1e-4 in fp32)."""
    assert len(run["log"]) == 1 and run["log"][0].endswith(
        ": float8='rowwise': converted 12 nn.Linear layers (emulated on the CPU: checks numerics only); skipped: head"
        " (output head)"
    )
    assert run["emulation_warned"] and not reference["emulation_warned"]
    assert run["weight_dtypes"] == run["optimizer_state_dtypes"] == ["torch.float32"]
    assert 0 < max_abs_diff(reference["losses"], run["losses"]) <= FP8_TOL


@pytest.mark.slow
def test_fsdp2_rowwise_converts_every_block_linear_and_stays_within_the_fp8_tolerance(two_rank_runs):
    run = two_rank_runs["fsdp2"]
    plain, rowwise = run["plain"], run["rowwise"]
    assert rowwise["converted"] == BLOCK_LINEARS and rowwise["plain"] == ["head"] and plain["converted"] == []
    _check_fp8_run(rowwise, plain)
    assert rowwise["all_gather"] == plain["all_gather"]  # rowwise all-gathers in the base precision


@pytest.mark.slow
def test_fsdp2_tensorwise_all_gathers_fp8_with_scales_precomputed_once_per_step(two_rank_runs):
    run = two_rank_runs["fsdp2"]
    plain, tensorwise = run["plain"], run["tensorwise"]
    assert "FP8 weight all-gather with scales precomputed after each optimizer step" in tensorwise["log"][0]
    ratio = tensorwise["all_gather"] / plain["all_gather"]
    assert ratio <= 0.5
    assert ratio == pytest.approx(run["theory_ratio"], rel=1e-6)  # 0.3356: every byte accounted for
    # One all-reduce more per step than fp32: the scales of all 12 weights at once, after the optimizer step.
    assert tensorwise["all_reduces"] == plain["all_reduces"] + 1
    assert max_abs_diff(plain["losses"], tensorwise["losses"]) <= FP8_TOL


@pytest.mark.slow
def test_an_fp8_fsdp2_checkpoint_holds_no_float8_and_resumes_in_fp32_tensor_parallel(two_rank_runs):
    run = two_rank_runs["fsdp2"]
    assert run["checkpoint_dtypes"] == ["torch.float32"]
    resumed, uninterrupted = run["resumed_in_tp"], run["tensorwise"]
    assert len(resumed["losses"]) == 3 and resumed["converted"] == []
    assert max_abs_diff(uninterrupted["losses"][3:], resumed["losses"]) <= FP8_TOL


@pytest.mark.slow
def test_a_tensorwise_fsdp2_checkpoint_loads_weights_only_and_resumes_in_tensorwise(two_rank_runs):
    """Tensorwise under fsdp2 wraps each weight in torchao's FP8 all-gather subclass; the checkpoint must hold the
    plain tensors inside it (readable with weights_only=True, without torchao), and loading it back into a
    tensorwise run must reach the wrapped weights."""
    run = two_rank_runs["fsdp2"]
    # torchao allow-lists its subclass for weights_only loads once imported (as here, after the fast tests), so read
    # the bytes: no torchao name at all, and the checkpoint loads on a machine without torchao.
    files = [f for f in Path(run["checkpoint"]).rglob("*") if f.is_file()]
    assert files and not [f.name for f in files if b"torchao" in f.read_bytes()]
    full = load_full_checkpoint(run["checkpoint"])  # weights_only=True
    optimizer = [v for s in full["optimizer_states"][0]["state"].values() for v in s.values() if v.dim() > 0]
    tensors = [*full["state_dict"].values(), *optimizer]
    assert {(type(t), t.dtype) for t in tensors} == {(torch.Tensor, torch.float32)}
    resumed, uninterrupted = run["resumed_tensorwise"], run["tensorwise"]
    assert len(resumed["losses"]) == 3 and resumed["converted"] == BLOCK_LINEARS
    assert resumed["losses"] == uninterrupted["losses"][3:]  # exactly: the same FP8 weights, scales and data


@pytest.mark.slow
def test_tensor_parallel_shards_the_fp8_layers_and_stays_within_the_tolerance(two_rank_runs):
    run = two_rank_runs["tensor_parallel"]
    _check_fp8_run(run, two_rank_runs["fsdp2"]["plain"])
    assert run["converted"] == BLOCK_LINEARS
    # The plan shards the converted layers as it would plain ones (a Float8Linear is still x @ W.T).
    assert {f"{n}.weight" for n in BLOCK_LINEARS} <= set(run["dtensor_params"])


@pytest.mark.slow
def test_context_parallel_trains_fp8_within_the_tolerance(two_rank_runs):
    run = two_rank_runs["context_parallel"]
    _check_fp8_run(run, two_rank_runs["fsdp2"]["plain"])
    assert run["converted"] == BLOCK_LINEARS


@pytest.mark.slow
def test_a_bf16_pipeline_checkpoint_resumes_with_fp8_within_the_tolerance(two_rank_runs):
    bf16, resumed = two_rank_runs["pipeline"]["bf16"], two_rank_runs["pipeline"]["bf16_resumed_in_fp8"]
    assert bf16["converted"] == [] and resumed["converted"] == [n for n in BLOCK_LINEARS if n.startswith("blocks.0.")]
    assert resumed["weight_dtypes"] == resumed["optimizer_state_dtypes"] == ["torch.float32"]  # bf16-mixed masters
    assert len(resumed["losses"]) == 3
    assert 0 < max_abs_diff(bf16["losses"][3:], resumed["losses"]) <= FP8_TOL


@pytest.mark.slow
def test_a_stock_transformers_llama_trains_fp8_under_fsdp2(two_rank_runs):
    """Tolerance 5e-2: this model trains at lr 1e-2 from the first step (no warm-up) and its GQA key/value
    projections are 32×16, the narrowest FP8 accepts, so the runs part faster than the example GPT's: 5e-4 after
    the first step (the GPT's size), 2.8e-2 by the sixth (measured)."""
    plain, fp8 = two_rank_runs["llama"]["plain"], two_rank_runs["llama"]["float8"]
    layers = [f"model.model.layers.{i}.{m}" for i in range(2) for m in LLAMA_LINEARS]
    assert fp8["converted"] == sorted(layers) and fp8["plain"] == ["model.lm_head"]
    assert fp8["log"][0].endswith("converted 14 nn.Linear layers (emulated on the CPU: checks numerics only);"
                                  " skipped: model.lm_head (output head)")  # fmt: skip
    assert fp8["weight_dtypes"] == fp8["optimizer_state_dtypes"] == ["torch.float32"]
    assert abs(plain["losses"][0] - fp8["losses"][0]) <= FP8_TOL
    assert 0 < max_abs_diff(plain["losses"], fp8["losses"]) <= 5e-2


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL_MATRIX, reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): fp8 under tp and pipeline runs at 2 ranks"
)
def test_hybrid3d_pp2_tp2_trains_fp8_within_the_tolerance(two_rank_runs, tmp_path):
    # The one 4-process launch of this file (2 cores: ~40-60 s, most of it starting 4 processes).
    run = run_scenarios(SCRIPT, 4, tmp_path, ["hybrid3d"])["hybrid3d"]
    _check_fp8_run(run, two_rank_runs["fsdp2"]["plain"])
    assert {f"{n}.weight" for n in BLOCK_LINEARS if n.startswith("blocks.0.")} <= set(run["dtensor_params"])


def test_the_fp8_config_and_the_precision_plugin_reach_the_strategy():
    from yaml_configs import cli_from_config

    from lightning_dist.plugins import Float8Precision

    cli = cli_from_config("configs/fsdp2_fp8.yaml")
    assert cli.trainer.strategy.float8_recipe == "tensorwise" and cli.trainer.strategy.float8_skip_patterns == ()
    plugin = Float8Precision("rowwise", precision="bf16-mixed", skip="blocks\\.0\\..*")
    trainer = L.Trainer(strategy="fsdp2", plugins=[plugin], accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.precision_plugin is plugin and trainer.strategy.float8_recipe == "rowwise"
    assert trainer.strategy.float8_skip_patterns == ("blocks\\.0\\..*",)
    clash = L.Trainer(strategy=FSDP2Strategy(float8="tensorwise"), plugins=[plugin], accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match="float8='tensorwise' and the precision plugin Float8Precision says"):
        clash.strategy.check_float8()
