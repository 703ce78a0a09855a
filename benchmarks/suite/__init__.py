"""The CPU scaling suite (``python -m benchmarks.run``, see docs/performance.md): step-time overhead as ratios,
per-rank memory and communication bytes against theory, at 1, 2 and 4 ranks.

:mod:`~benchmarks.suite.run` (the command) → :mod:`~benchmarks.suite.workloads` (what is measured: our strategies
and the hand-written :mod:`~benchmarks.suite.baselines`) → :mod:`~benchmarks.suite.launch` (one launch per world
size) → :mod:`~benchmarks.suite.worker` (every rank) → :mod:`~benchmarks.suite.analysis` (rows, against
:mod:`~benchmarks.suite.theory`) → :mod:`~benchmarks.suite.tables` (markdown) → :mod:`~benchmarks.suite.report`
(``report.md`` and the plot) and :mod:`~benchmarks.suite.docs_section` (the section of docs/performance.md).
"""

from benchmarks.suite import theory
from benchmarks.suite.analysis import analyze, memory_rows
from benchmarks.suite.docs_section import SECTION_END, SECTION_START, performance_section, update_performance_doc
from benchmarks.suite.report import plot, to_markdown, write_report
from benchmarks.suite.run import choose_device
from benchmarks.suite.tables import memory_table
from benchmarks.suite.workloads import BY_NAME, TIME_COMPARISONS, WORKLOADS, Workload, availability, layout_for

__all__ = [
    "BY_NAME", "SECTION_END", "SECTION_START", "TIME_COMPARISONS", "WORKLOADS", "Workload", "analyze",
    "availability", "choose_device", "layout_for", "memory_rows", "memory_table", "performance_section", "plot",
    "theory", "to_markdown", "update_performance_doc", "write_report",
]  # fmt: skip
