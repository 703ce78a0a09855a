"""The compatibility matrix (``python -m benchmarks.compatibility``, regenerates docs/compatibility.md): every
strategy family × third-party models, each cell trained for a few steps against one process, or refused.

:mod:`~benchmarks.compatibility.runner` (the command: references, pre-launch checks, one launch per layout) →
:mod:`~benchmarks.compatibility.worker` (every rank); the rows are :mod:`~benchmarks.compatibility.models`, the
columns and outcome rules :mod:`~benchmarks.compatibility.cells`, the page :mod:`~benchmarks.compatibility.table`.
"""

from benchmarks.compatibility.cells import (
    COLUMNS,
    FP32_TOLERANCE,
    FP64_TOLERANCE,
    ZEROPP_LOSS_REL_TOLERANCE,
    Column,
    compare,
    describe_failure,
)
from benchmarks.compatibility.models import MODELS
from benchmarks.compatibility.runner import DOCS, RESULTS, merge_ranks, run_matrix, versions
from benchmarks.compatibility.table import render

__all__ = [
    "COLUMNS", "DOCS", "FP32_TOLERANCE", "FP64_TOLERANCE", "MODELS", "RESULTS", "ZEROPP_LOSS_REL_TOLERANCE", "Column",
    "compare", "describe_failure", "merge_ranks", "render", "run_matrix", "versions",
]  # fmt: skip
