"""The verify matrix's bookkeeping, without training: its table from recorded results (written only between the
page's markers) and how a run's log decides between a refusal and a defect."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.verify import END, START, render_section, run_error, update_doc

DIFFERENT = "DIFFERENT: first at step 0: gradients (head.weight) differs by 1.00e-02 (tolerance 1e-04)."
TIED = "lightning_dist.parallel.X.TensorParallelPlanError: tied weight"
RESULTS = {
    "cells": {
        "float32": {
            "gpt": {
                "fsdp2": {"outcome": "passed", "seconds": 41.2, "max_diff": 3.1e-7, "mesh": "dp_shard=2"},
                "tensor_parallel": {"outcome": "defect", "seconds": 50.0, "defect": DIFFERENT},
            },
            "bert": {
                "tensor_parallel": {"outcome": "refused", "seconds": 12.0, "when": "before launch", "error": TIED},
                "tensor_parallel_2d": {"outcome": "refused", "seconds": 14.0, "when": "before launch", "error": TIED},
            },
        },
        "float64": {"llama": {"pipeline": {"outcome": "passed", "seconds": 30.0, "max_diff": 2e-15}}},
    },
    "versions": {"torch": "2.13.0"},
    "updated": "2026-11-25 09:00 UTC",
}


def test_the_table_shows_each_outcome_and_names_refusals_once():
    section = render_section(RESULTS)
    assert section.startswith(START) and section.endswith(END)
    assert "1 passed, 2 refused, 1 defects" in section and "1 passed, 0 refused, 0 defects" in section
    fsdp2 = next(line for line in section.splitlines() if line.startswith("| `fsdp2` | dp_shard=2 |"))
    assert "| ✅ 3e-07 · 41 s | not run |" in fsdp2
    tp = next(line for line in section.splitlines() if line.startswith("| `tensor_parallel` | tp=2 |"))
    assert "❌ [D1](#d1) · 50 s" in tp and "⛔ [R1](#r1) · 12 s" in tp
    tp2d = next(line for line in section.splitlines() if line.startswith("| `tensor_parallel_2d` |"))
    assert "⛔ [R1](#r1) · 14 s" in tp2d  # the same message: one footnote
    assert section.count('<a id="r1"></a>') == 1 and "**R1** TensorParallelPlanError: tied weight" in section
    assert '<a id="d1"></a>**D1** DIFFERENT: first at step 0: gradients (head.weight)' in section
    fp64 = section.split("**fp64**", 1)[1]
    assert "✅ 2e-15 · 30 s" in fp64 and "`zeropp`" not in fp64.split("Refusals")[0]  # fp64: its five columns


def test_only_the_marked_region_of_the_page_is_written(tmp_path: Path):
    page = tmp_path / "verify.md"
    page.write_text(f"# verify\n\nhand-written\n\n{START}\n(not yet recorded)\n{END}\n\nafter\n")
    assert update_doc(page, RESULTS) == page
    text = page.read_text()
    assert text.startswith("# verify\n\nhand-written\n\n") and text.endswith(f"{END}\n\nafter\n")
    assert "(not yet recorded)" not in text and text.count(START) == 1
    plain = tmp_path / "other.md"
    plain.write_text("no markers\n")
    assert update_doc(plain, json.loads(json.dumps(RESULTS))) == tmp_path / "verify_matrix.md"
    assert plain.read_text() == "no markers\n" and START in (tmp_path / "verify_matrix.md").read_text()


LOG = """Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2
Traceback (most recent call last):
  File "/repo/lightning_dist/verification/phase.py", line 130, in <module>
    run(Path(sys.argv[1]), sys.argv[2])
  File "{path}", line 12, in check
    {code}
{error}
"""


def test_a_refusal_is_an_error_the_package_raises_on_purpose(tmp_path: Path):
    log = tmp_path / "candidate.log"
    cases = [
        ("/repo/lightning_dist/parallel/plan.py", "raise TensorParallelPlanError(message)",
         "lightning_dist.parallel.plan.TensorParallelPlanError: tied weight", True),
        ("/repo/lightning_dist/strategies/pipeline.py", "raise ValueError(f'encoder-decoder')",
         "ValueError: encoder-decoder", True),
        ("/repo/lightning_dist/strategies/pipeline.py", "assert stage is not None", "AssertionError", False),
        ("/repo/lightning_dist/parallel/plan.py", "raise KeyError(name)", "KeyError: 'x'", False),
        ("/site-packages/torch/distributed/tensor/_api.py", "raise RuntimeError('x')", "RuntimeError: x", False),
    ]  # fmt: skip
    for path, code, error, deliberate in cases:
        log.write_text(LOG.format(path=path, code=code, error=error))
        found = run_error(log)
        assert found["deliberate"] is deliberate, (code, found)
        assert found["error"] == error and found["when"] == "after launch"
        assert found["where"] == f"{Path(path).name}:12"
    log.write_text(LOG.format(path=cases[0][0], code=cases[0][1], error=cases[0][2]).split("\n", 1)[1])
    assert run_error(log)["when"] == "before launch"
    # torch prefixes each line of a rank's error; a message goes on over several lines
    text = LOG.format(path=cases[0][0], code=cases[0][1], error=cases[0][2] + "\n  - a.weight: tied\nPass a plan.")
    log.write_text("".join(f"[rank1]: {line}\n" for line in text.splitlines()))
    found = run_error(log)
    assert found["deliberate"] and found["error"] == cases[0][2] + " - a.weight: tied Pass a plan."
