"""Benchmarks, in families (the commands, what each measures and where its results go: ``benchmarks/README.md``).

* :mod:`benchmarks.common` — the one process launcher, the scenario convention, measuring, model sizes, hardware.
* :mod:`benchmarks.suite` — the CPU scaling suite, ``python -m benchmarks.run``.
* :mod:`benchmarks.compatibility` — strategies × third-party models, ``python -m benchmarks.compatibility``.
* :mod:`benchmarks.verify` — ``lightning-dist verify`` over the matrix, ``python -m benchmarks.verify_matrix`` and
  ``python -m benchmarks.verify_moe``.
* :mod:`benchmarks.gpu` — what needs CUDA: ``python -m benchmarks.run --gpu``, ``benchmarks.gpu_moe``,
  ``benchmarks.gpu_local_experts``.
* :mod:`benchmarks.studies` — one measurement per docs page: pipeline, context_parallel, float8_parity,
  planner_accuracy, checkpoint_integrity, checkpoint_security (each ``python -m benchmarks.<name>``).

The ``.py`` files beside this one are shims that keep those commands working.
"""
