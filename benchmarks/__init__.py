"""Benchmark suite: step-time overhead (as ratios), per-rank memory and communication bytes, and their scaling.

Run it with ``python -m benchmarks.suite.run [--quick] [--out DIR]`` (see :mod:`benchmarks.suite.run`). Modules, one job each:

* :mod:`benchmarks.common.models` — the example GPT at several sizes; parameter and FLOP counts.
* :mod:`benchmarks.suite.workloads` — the list of measured configurations (our strategies and the hand-written baselines).
* :mod:`benchmarks.suite.baselines` — hand-written ``configure_model`` modules for ``ModelParallelStrategy`` and the raw
  ``fully_shard`` loop without Lightning.
* :mod:`benchmarks.common.measure` — step timing statistics, activation / process memory, communication aggregation.
* :mod:`benchmarks.suite.theory` — the textbook communication and memory formulas the measurements are compared with.
* :mod:`benchmarks.common.hardware` — tokens/s and MFU (device peak FLOP/s lookup), CUDA only.
* :mod:`benchmarks.suite.worker` / :mod:`benchmarks.common.launch` — one process per rank (torchrun-like) running a plan.
* :mod:`benchmarks.suite.report` — JSON results to ``report.md`` and a PNG plot; the rows are :mod:`benchmarks.suite.analysis`,
  their markdown :mod:`benchmarks.suite.tables`, the measured section of ``docs/performance.md`` :mod:`benchmarks.suite.docs_section`.

The compatibility matrix (strategies × third-party models against one process, regenerating
``docs/compatibility.md``) is ``python -m benchmarks.compatibility.runner``: :mod:`benchmarks.compatibility.runner` (the runner),
:mod:`benchmarks.compatibility.models` (rows), :mod:`benchmarks.compatibility.cells` (columns, outcome rules),
:mod:`benchmarks.compatibility.worker` (one rank) and :mod:`benchmarks.compatibility.table` (the page).
"""
