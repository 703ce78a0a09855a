"""Benchmark suite: step-time overhead (as ratios), per-rank memory and communication bytes, and their scaling.

Run it with ``python -m benchmarks.run [--quick] [--out DIR]`` (see :mod:`benchmarks.run`). Modules, one job each:

* :mod:`benchmarks.models` — the example GPT at several sizes; parameter and FLOP counts.
* :mod:`benchmarks.workloads` — the list of measured configurations (our strategies and the hand-written baselines).
* :mod:`benchmarks.baselines` — hand-written ``configure_model`` modules for ``ModelParallelStrategy`` and the raw
  ``fully_shard`` loop without Lightning.
* :mod:`benchmarks.measure` — step timing statistics, activation / process memory, communication aggregation.
* :mod:`benchmarks.theory` — the textbook communication and memory formulas the measurements are compared with.
* :mod:`benchmarks.hardware` — tokens/s and MFU (device peak FLOP/s lookup), CUDA only.
* :mod:`benchmarks.worker` / :mod:`benchmarks.launch` — one process per rank (torchrun-like) running a plan.
* :mod:`benchmarks.report` — JSON results to ``report.md`` and a PNG plot; the rows are :mod:`benchmarks.analysis`,
  their markdown :mod:`benchmarks.tables`, the measured section of ``docs/performance.md`` :mod:`benchmarks.docs_section`.

The compatibility matrix (strategies × third-party models against one process, regenerating
``docs/compatibility.md``) is ``python -m benchmarks.compatibility``: :mod:`benchmarks.compatibility` (the runner),
:mod:`benchmarks.compat_models` (rows), :mod:`benchmarks.compat_cells` (columns, outcome rules),
:mod:`benchmarks.compat_worker` (one rank) and :mod:`benchmarks.compat_table` (the page).
"""
