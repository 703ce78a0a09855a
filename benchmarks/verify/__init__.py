"""``lightning-dist verify`` over the compatibility matrix's models and columns (``python -m
benchmarks.verify_matrix``, the table of docs/verify.md) and over the mixture-of-experts models (``python -m
benchmarks.verify_moe``, docs/expert_parallel.md).

:mod:`~benchmarks.verify.matrix` (the command, one cell at a time) with its rows in
:mod:`~benchmarks.verify.models` and its table in :mod:`~benchmarks.verify.table`; :mod:`~benchmarks.verify.moe`.
"""

from benchmarks.verify.matrix import run_error
from benchmarks.verify.table import END, START, render_section, update_doc

__all__ = ["END", "START", "render_section", "run_error", "update_doc"]
