"""The ``compile`` option: validation, the compile step of ``parallelize``, user-compiled models, and real runs.

The runs (marked slow) compile with inductor on the CPU (gcc builds the kernels) in fp64, 2 ranks in one launch.
fsdp2, tensor_parallel, pipeline (pp=2) and context parallel (cp=2, through hybrid3d) must match one process to 1e-10
absolute, the tolerance of the uncompiled parity tests (the generated kernels change only the order of fp64
reductions; observed ≤ 4e-14 on parameters), and zeropp (quantized collectives) its own uncompiled run to the same
1e-10. Checkpoints move between compiled and uncompiled runs with the uncompiled model's keys. Compilation on 2 cores
dominates the launch: the first step's time is printed.
"""

from __future__ import annotations

import pytest
import torch
from launch import max_abs_diff, run_scenarios
from torch import nn

from lightning_dist import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    ZeroPPStrategy,
)

EVERY_STRATEGY = [
    FSDP2Strategy,
    TensorParallelStrategy,
    ZeroPPStrategy,
    PipelineStrategy,
    ContextParallelStrategy,
    Hybrid3DStrategy,
]
from lightning_dist.compat import is_compiled_in_place
from lightning_dist.parallel.compile import resolve_compile_options, unwrap_user_compiled
from lightning_dist.parallel.parallelize import ParallelizeConfig, parallelize

FP64_TOL = 1e-10
SCRIPT = "compile_runs.py"
COMPILE_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


# ---------------------------------------------------------------------------------------------- the option (fast)
@pytest.mark.parametrize("cls", EVERY_STRATEGY)
def test_every_strategy_takes_compile(cls):
    assert cls().compile_options is None
    assert cls(compile=False).compile_options is None
    assert cls(compile=True).compile_options == {}
    options = {"mode": "max-autotune-no-cudagraphs", "dynamic": False}
    assert cls(compile=options).compile_options == options


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("yes", TypeError, r"compile='yes' \(str\): expected False \(default\), True"),
        (1, TypeError, r"compile=1 \(int\)"),
        ({"fullgrph": True}, ValueError, r"'fullgrph' is not a keyword of torch.compile.*fullgraph"),
        ({"mode": "fastest"}, ValueError, r"mode='fastest' is not one of"),
        ({"backend": 3}, ValueError, r"backend=3 is neither"),
    ],
)
def test_a_bad_compile_value_is_refused_at_construction(value, error, match):
    with pytest.raises(error, match=match):
        FSDP2Strategy(compile=value)
    with pytest.raises(error, match=match):
        resolve_compile_options(value)


@pytest.mark.parametrize("cls", EVERY_STRATEGY)
def test_compile_from_yaml(cls):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "strategy")
    for text, expected in (
        ("true", {}),
        ("false", None),
        (
            "{mode: max-autotune-no-cudagraphs, dynamic: false}",
            {"mode": "max-autotune-no-cudagraphs", "dynamic": False},
        ),
    ):
        parsed = parser.parse_string(f"strategy:\n  compile: {text}\n")
        assert parser.instantiate_classes(parsed).strategy.compile_options == expected
    with pytest.raises(Exception, match="compile"):
        parser.parse_string("strategy:\n  compile: often\n")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(4, 2)


def test_parallelize_compiles_each_unit_in_place_and_names_stay():
    net = _Net()
    names = [n for n, _ in net.named_parameters()]
    config = ParallelizeConfig(units=list(net.blocks.named_children()), compile={"dynamic": False})
    record = parallelize(net, None, config)  # type: ignore[arg-type]  # no axis on: no mesh needed
    assert all(is_compiled_in_place(b) for b in net.blocks)
    assert not is_compiled_in_place(net.head)  # outside the blocks: eager (see parallelize's docstring)
    assert [n for n, _ in net.named_parameters()] == names
    assert record.compiled is not None and "compiled 2 × _Block with torch.compile(dynamic=False)" in record.compiled
    assert parallelize(_Net(), None, ParallelizeConfig()).compiled is None  # type: ignore[arg-type]
    nothing = parallelize(_Net(), None, ParallelizeConfig(compile={}))  # type: ignore[arg-type]
    assert nothing.compiled is not None and nothing.compiled.startswith("compile: no repeated blocks found")


def test_user_compiled_submodules_are_unwrapped_with_clean_names():
    net = _Net()
    plain = [n for n, _ in net.named_parameters()]
    net.blocks[1] = torch.compile(net.blocks[1])
    net.blocks = torch.compile(net.blocks)  # nested: the outer wrapper and the one inside it go
    net.head = torch.compile(net.head)
    assert any("_orig_mod" in n for n, _ in net.named_parameters())
    unwrapped = unwrap_user_compiled(net)
    assert sorted(name for name, _ in unwrapped) == ["blocks", "blocks.1", "head"]
    assert [n for n, _ in net.named_parameters()] == plain
    assert unwrap_user_compiled(net) == []


# ---------------------------------------------------------------------------------------------- real runs (slow)
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("compile")


@pytest.fixture(scope="module")
def runs(workdir):
    reference = run_scenarios(SCRIPT, 1, workdir, ["reference"])["reference"]
    scenarios = ["fsdp2", "tensor_parallel", "pipeline", "context_parallel", "zeropp", "uncompiled_load",
                 "user_compiled", "user_compiled_kept"]  # fmt: skip
    # Kernels are built in each rank's own process: a pool of compile workers costs more than it saves on 2 cores.
    return {"reference": reference, **run_scenarios(SCRIPT, 2, workdir, scenarios, env=COMPILE_ENV)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2", "tensor_parallel"])
def test_compiled_runs_match_one_process(runs, workdir, name):
    run, ref = runs[name], runs["reference"]
    assert run["compiled_blocks"] == 2
    assert any("compiled 2 × Block with torch.compile()" in line for line in run["log"]), run["log"]
    assert max_abs_diff(run["losses"], ref["losses"]) < FP64_TOL
    assert max_abs_diff(run["grad_norms"], ref["grad_norms"]) < FP64_TOL
    params, ref_params = torch.load(workdir / f"{name}.pt"), torch.load(workdir / "reference.pt")
    assert sorted(params) == sorted(ref_params)
    assert max((params[n] - ref_params[n]).abs().max().item() for n in params) < FP64_TOL
    first, rest = run["step_seconds"][0], run["step_seconds"][1:]
    print(f"\n{name} compile=True: first step {first:.1f} s (compiles), later steps {max(rest):.2f} s at most")


@pytest.mark.slow
def test_compiled_pipeline_stages_and_context_parallel_blocks_match_one_process(runs, workdir):
    """pp=2: each rank compiles the block of its own stage; cp=2 (hybrid3d): the compiled blocks call ring attention."""
    ref, ref_params = runs["reference"], torch.load(workdir / "reference.pt")
    stages = {**torch.load(workdir / "pipeline.rank0.pt"), **torch.load(workdir / "pipeline.rank1.pt")}
    for name, params, blocks in (
        ("pipeline", stages, 1),
        ("context_parallel", torch.load(workdir / "context_parallel.pt"), 2),
    ):
        run = runs[name]
        assert run["compiled_blocks"] == blocks, name
        assert any(f"compiled {blocks} × Block with torch.compile()" in line for line in run["log"]), run["log"]
        assert max_abs_diff(run["losses"], ref["losses"]) < FP64_TOL, name
        assert max_abs_diff(run["grad_norms"], ref["grad_norms"]) < FP64_TOL, name
        assert sorted(params) == sorted(ref_params), name
        assert max((params[n] - ref_params[n]).abs().max().item() for n in params) < FP64_TOL, name


@pytest.mark.slow
def test_zeropp_custom_collectives_give_the_same_losses_compiled(runs):
    eager, compiled = runs["zeropp"]["eager"], runs["zeropp"]["on"]
    assert max_abs_diff(compiled, eager) < FP64_TOL


@pytest.mark.slow
def test_checkpoints_move_between_compiled_and_uncompiled_runs_with_the_same_keys(runs):
    keys = runs["uncompiled_load"]["keys"]  # saved by an uncompiled run
    assert keys and not any("_orig_mod" in k for k in keys)
    for name in ("fsdp2", "user_compiled", "user_compiled_kept"):
        assert runs[name]["keys"] == keys, name
    # compiled → uncompiled, and uncompiled → compiled (user-compiled model under compile=True): exact weights
    assert runs["uncompiled_load"]["loaded_param_diff"] == 0.0
    assert runs["user_compiled"]["loaded_param_diff"] == 0.0
    assert abs(runs["user_compiled"]["val_loss"] - runs["uncompiled_load"]["val_loss"]) < FP64_TOL


@pytest.mark.slow
def test_a_user_compiled_model_gets_no_orig_mod_names(runs):
    ours, kept = runs["user_compiled"], runs["user_compiled_kept"]
    assert ours["names_with_orig_mod"] == [] and kept["names_with_orig_mod"] == []
    assert ours["compiled_blocks"] == 2 and kept["compiled_blocks"] == 2
    assert any("unwrapped, compiled per block" in line for line in ours["log"]), ours["log"]
    assert len(kept["warnings"]) == 1 and "compile=True" in kept["warnings"][0]
