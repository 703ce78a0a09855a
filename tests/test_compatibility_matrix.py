"""The compatibility matrix (``benchmarks/compatibility/``): a few cells run for real, how outcomes are told
apart, and ``docs/compatibility.md`` being exactly what the runner generates from its recorded results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.compatibility import (
    COLUMNS,
    DOCS,
    FP32_TOLERANCE,
    FP64_TOLERANCE,
    MODELS,
    RESULTS,
    ZEROPP_LOSS_REL_TOLERANCE,
    compare,
    describe_failure,
    merge_ranks,
    render,
    run_matrix,
)
from lightning_dist.parallel.context_parallel.outputs import PooledOutputError
from lightning_dist.parallel.mesh import MeshConfigError, ParallelDims


def _raised(function) -> BaseException:
    try:
        function()
    except BaseException as error:  # noqa: BLE001
        return error
    raise AssertionError("nothing raised")


def test_a_refusal_is_told_from_a_defect_by_who_raised_it_and_when():
    def refuse() -> None:  # the package's own refusal, raised by its own code
        ParallelDims.resolve(4, dp_shard=3, tp=2)

    refusal = _raised(refuse)
    assert isinstance(refusal, MeshConfigError)
    assert describe_failure(refusal, 0, constructing=True)["outcome"] == "refused"
    assert describe_failure(refusal, 0, constructing=True)["when"] == "before launch"
    late = describe_failure(refusal, 0)  # after launch, and not something only the output tells
    assert (
        late["outcome"] == "defect" and late["when"] == "after launch" and "could tell before launch" in late["defect"]
    )

    pooled = describe_failure(PooledOutputError("pooled"), 0)
    assert (pooled["outcome"], pooled["when"]) == ("refused", "at the first step")
    assert describe_failure(PooledOutputError("pooled"), 1)["outcome"] == "defect"  # after an optimizer step

    torch_error = _raised(lambda: torch.zeros(2, 3) @ torch.zeros(2, 3))
    record = describe_failure(torch_error, 0, constructing=True)
    assert record["outcome"] == "defect" and "(at " in record["error"]  # names where it came from
    assert describe_failure(_raised(lambda: {}["x"]), 2)["when"] == "at step 3"


def test_parity_needs_losses_and_parameters_within_the_tolerance():
    fsdp2, zeropp = COLUMNS["fsdp2"], COLUMNS["zeropp"]
    assert compare(fsdp2, [1.0, 2.0], [1.0, 2.0 + 1e-12], 3e-14)["outcome"] == "parity"
    assert compare(fsdp2, [1.0, 2.0], [1.0, 2.0], 10 * FP64_TOLERANCE)["outcome"] == "defect"  # parameters
    assert compare(fsdp2, [1.0, 2.0], [1.0, 2.0 + 1e-9], 0.0)["outcome"] == "defect"  # a loss
    assert compare(fsdp2, [1.0], [1.0, 2.0], 0.0)["outcome"] == "defect"  # steps missing
    assert compare(zeropp, [1.0, 2.02], [1.0, 2.0], None)["outcome"] == "parity"  # 1% relative, quantized
    assert compare(zeropp, [1.0, 2.2], [1.0, 2.0], None)["outcome"] == "defect"


def test_ranks_that_disagree_make_a_defect_naming_the_rank_that_failed_first():
    parity = {"outcome": "parity", "max_diff": 1e-15}
    knock_on = {"outcome": "defect", "when": "after launch", "error": "RuntimeError: Connection closed by peer"}
    own = {"outcome": "defect", "when": "after launch", "error": "ValueError: the real cause"}
    assert merge_ranks([parity, parity]) == parity
    merged = merge_ranks([knock_on, own])
    assert merged["outcome"] == "defect" and merged["error"] == "rank 1: ValueError: the real cause"
    assert merge_ranks([parity, own])["outcome"] == "defect"


@pytest.mark.slow
def test_cells_run_for_real(tmp_path: Path):
    """Tied GPT-2 under pipeline matches one process; T5 under pipeline is refused before launch; the Llama started
    from initial_weights (built on the meta device) matches the Llama's one process; a table of the three names all."""
    cells = run_matrix(["gpt2", "t5", "llama_initial_weights"], ["pipeline"], tmp_path)
    gpt2, t5 = cells["gpt2"]["pipeline"], cells["t5"]["pipeline"]
    pretrained = cells["llama_initial_weights"]["pipeline"]
    assert pretrained["outcome"] == "parity" and pretrained["max_diff"] <= FP64_TOLERANCE, pretrained
    assert gpt2["outcome"] == "parity" and gpt2["max_diff"] <= FP64_TOLERANCE, gpt2
    assert gpt2["param_diff"] is not None and gpt2["param_diff"] <= FP64_TOLERANCE
    assert (t5["outcome"], t5["when"]) == ("refused", "before launch"), t5
    assert "encoder–decoder" in t5["error"]
    assert not (tmp_path / "roots" / "t5@pipeline").exists()  # the refused run left no directory
    page = render({"cells": cells})
    assert f"✅ {gpt2['max_diff']:.0e}" in page and "⛔ before launch [R1](#r1)" in page and t5["error"] in page
    recorded = _recorded()["cells"]  # the published table says the same of these two cells
    assert recorded["gpt2"]["pipeline"]["outcome"] == "parity"
    assert (recorded["t5"]["pipeline"]["outcome"], recorded["t5"]["pipeline"]["when"]) == ("refused", "before launch")


def _recorded() -> dict:
    return json.loads(RESULTS.read_text())


def test_the_page_is_what_the_runner_generates_from_its_recorded_results():
    assert DOCS.read_text() == render(_recorded()), (
        "docs/compatibility.md differs from the recorded results: rerun `python -m benchmarks.compatibility` (or"
        " `--render` after editing benchmarks/compatibility/table.py); never edit the page by hand"
    )


def test_the_recorded_matrix_has_every_cell_and_each_outcome_is_well_formed():
    cells = _recorded()["cells"]
    missing = [f"{m} × {c}" for m in MODELS for c in COLUMNS if c not in cells.get(m, {})]
    assert not missing, f"cells never run (rerun the matrix for them): {missing}"
    for model, row in cells.items():
        for column, record in row.items():
            where = f"{model} × {column}: {record}"
            if record["outcome"] == "parity":
                tolerance = FP32_TOLERANCE if MODELS[model].why_fp32 else FP64_TOLERANCE
                tolerance = ZEROPP_LOSS_REL_TOLERANCE if COLUMNS[column].quantized else tolerance
                assert record["max_diff"] <= tolerance and record["mesh"] == COLUMNS[column].mesh, where
            elif record["outcome"] == "refused":
                assert record["when"] in ("before launch", "at the first step") and record["error"], where
            else:
                assert record["outcome"] == "defect" and record["defect"], where
